"""Per-step latency of a cached step, five ways: the jitted Python model, the exported step
through `dense_armor.export.load`, the IREE-compiled static step through IREE's runtime
(`iree.runtime`, the cache kept on the device from call to call) on its `local-sync` device (the
dispatches on the calling thread) and its `local-task` device (a thread pool), and the artifact's
C runner (`runner.c`) on XLA's PJRT CPU plugin, the weights and the cache resident on the device
and each step's output copied to the host, with no Python in its process.

Two models at B=1 and B=8: the main job's architecture (examples/digits.py: d_model 64, 4 heads,
depth 2, max_len 8) and an encoder of d_model 256, 8 heads, d_ff 1024, depth 4, both with fresh
weights. Each system runs a stream of 8 steps from an empty cache per round; the Python-driven
systems are interleaved in one process, and the C runner (its own process: `--repeat`, the median
over every step it ran) runs between their rounds. Also printed: where the time of one Python
step goes.
"""

import pathlib
import re
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dense_armor.checkpoints import ModelConfig
from dense_armor.export import export_model, load
from dense_armor.export.iree import compile_artifact
from dense_armor.export.standalone import build_runner, default_plugin

from .harness import interleaved, record, table

STEPS = 8
BATCHES = (1, 8)
CHUNKS = 4  # the Python systems' rounds in this many parts, the C runner run after each


def _digits_config():  # examples/ is not a package: read its config through the file
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "digits.py"
    spec = importlib.util.spec_from_file_location("digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model_config()


WIDE = ModelConfig(
    "transformer_encoder",
    {"n_in": 16, "d_model": 256, "n_heads": 8, "d_ff": 1024, "depth": 4, "n_out": 10,
     "max_len": STEPS, "causal": True},
)  # fmt: skip


def _c_runner(binary: pathlib.Path, art: pathlib.Path, repeat: int) -> dict[int, float]:
    """The C runner's median seconds per step of each batch size's stream."""
    done = subprocess.run(
        [str(binary), str(art), "--plugin", str(default_plugin()), "--repeat", str(repeat)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the C runner failed: {done.stdout}{done.stderr}")
    found = re.findall(r"pjrt step B=(\d+), \d+ steps.*\n\s+([\d.]+) us per step", done.stdout)
    return {int(b): float(us) * 1e-6 for b, us in found}


def run() -> str:
    lines = []
    work = pathlib.Path(tempfile.mkdtemp())
    for label, config in (("digits model", _digits_config()), ("d_model 256, depth 4", WIDE)):
        lines += _one_model(label, config, work / label.split()[0])
    return "\n".join(lines)


def _one_model(label: str, config: ModelConfig, work: pathlib.Path) -> list[str]:
    import iree.runtime as ireert

    model = config.build(jax.random.PRNGKey(0))
    n_in = config.arguments["n_in"]
    art = work / "art"
    export_model(
        model,
        config,
        art,
        capacity=STEPS,
        platforms=["cpu"],
        static_shapes=[(b, STEPS) for b in BATCHES],
    )
    compile_artifact(art, ["llvm-cpu"])
    build_runner(art, work / "runner")
    artifact = load(art)
    manifest = artifact.manifest
    step = jax.jit(lambda m, x, c: m.step(x, c), donate_argnums=2)
    systems_by_batch, lines = {}, []
    for b in BATCHES:
        xs = np.asarray(jax.random.normal(jax.random.PRNGKey(b), (STEPS, b, n_in)), np.float32)

        # 1. the Python model, jitted, its fixed cache donated (a batch of streams by vmap)
        python_start = jax.vmap(lambda _: model.init_cache(STEPS, on_overflow="nan"))(jnp.arange(b))
        batched = jax.jit(jax.vmap(lambda x, c: model.step(x, c), in_axes=(0, 0)), donate_argnums=1)
        rows = [jnp.asarray(x) for x in xs]

        def python_stream(batched=batched, python_start=python_start, rows=rows):
            cache = jax.tree.map(jnp.copy, python_start)
            for x in rows:
                y, cache = batched(x, cache)
            return y

        # 2. the exported step through the loader (input checks included)
        def loaded_stream(b=b, xs=xs):
            cache = artifact.init_cache(b)
            for x in xs:
                y, cache, _ = artifact.step(x, cache)
            return y

        # 3. the IREE module through IREE's runtime; weights and cache stay on the device
        entry = next(
            e for e in manifest["static"] if e["function"] == "step" and e["shape"]["B"] == b
        )
        vmfb = next(c["file"] for c in manifest["compiled"] if c["module"] == entry["bytecode"])
        kept = entry["kept_inputs"]
        start_cache = [np.asarray(c) for c in artifact.init_cache(b)]

        def iree_stream_on(driver: str, vmfb=vmfb, kept=kept, start_cache=start_cache, xs=xs):
            """IREE's runtime on `driver`: `local-sync` runs the dispatches on the calling
            thread, `local-task` hands them to a thread pool."""
            iree_config = ireert.Config(driver)
            context = ireert.SystemContext(config=iree_config)
            vm_module = ireert.VmModule.mmap(iree_config.vm_instance, str(art / vmfb))
            context.add_vm_module(vm_module)
            main = context.modules[vm_module.name]["main"]  # named after the jitted function
            device = iree_config.device
            weights = [ireert.asdevicearray(device, np.asarray(w)) for w in artifact.weights]
            on_device = [ireert.asdevicearray(device, x) for x in xs]

            def stream():
                cache = [ireert.asdevicearray(device, c) for c in start_cache]
                for x in on_device:
                    every = [*weights, x, *cache]
                    outputs = main(*[every[i] for i in kept])
                    y, cache = outputs[0], list(outputs[1:-1])
                return np.asarray(y.to_host())

            return stream

        systems = {
            "jitted Python step": python_stream,
            "export.load step": loaded_stream,
            "IREE runtime, local-sync": iree_stream_on("local-sync"),
            "IREE runtime, local-task": iree_stream_on("local-task"),
        }
        expected = np.asarray(python_stream())  # they agree
        for name, other in systems.items():
            np.testing.assert_allclose(np.asarray(other()), expected, atol=1e-4, err_msg=name)
        systems_by_batch[b] = systems

    for b, systems in systems_by_batch.items():
        medians: dict[str, list[float]] = {name: [] for name in systems}
        runner: list[float] = []
        for _ in range(CHUNKS):
            for name, seconds in interleaved(systems, rounds=10).items():
                medians[name].append(seconds / STEPS)
            runner.append(_c_runner(work / "runner", art, repeat=40)[b])
        per_step = {name: statistics.median(m) for name, m in medians.items()}
        per_step["C runner, PJRT CPU plugin"] = statistics.median(runner)
        for name, seconds in per_step.items():
            record(f"deploy {label} B={b}/{name}", seconds)
        lines.append(
            table(
                f"cached step of the {label}, B={b}, per step (streams of {STEPS} steps)",
                per_step,
                "jitted Python step",
            )
        )

    # What one jitted Python step spends: dispatch of the pytree against the compiled call.
    rows1 = jnp.zeros((n_in,), jnp.float32)
    start1 = model.init_cache(STEPS, on_overflow="nan")
    compiled = step.lower(model, rows1, start1).compile()
    flat_args = jax.tree.leaves((model, rows1, start1))
    n = 200
    cache = jax.tree.map(jnp.copy, start1)
    started = time.perf_counter()
    for _ in range(n):
        y, cache = compiled(model, rows1, cache)
        jax.block_until_ready(y)
    compiled_us = (time.perf_counter() - started) / n * 1e6
    lines.append(
        f"  one jitted step at B=1: {len(flat_args)} array arguments flattened and dispatched; "
        f"through the AOT-compiled executable {compiled_us:.0f} us per step"
    )
    return lines
