"""Per-step latency of the digits model's cached step at B=1, three ways: the jitted Python model,
the exported step through `dense_armor.export.load`, and the IREE-compiled static step through
IREE's runtime (`iree.runtime`, the cache kept on the device from call to call), on its
`local-sync` device (the dispatches on the calling thread) and its `local-task` device (a thread
pool).

The model is the main job's architecture (examples/digits.py: d_model 64, 4 heads, depth 2,
max_len 8) with fresh weights; each system runs a stream of 8 steps from an empty cache per
round, interleaved. Also printed: where the time of one Python step goes.
"""

import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dense_armor.export import export_model, load
from dense_armor.export.iree import compile_artifact

from .harness import interleaved, table

STEPS = 8


def _digits_config():  # examples/ is not a package: read its config through the file
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "digits.py"
    spec = importlib.util.spec_from_file_location("digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model_config()


def run() -> str:
    import iree.runtime as ireert

    config = _digits_config()
    model = config.build(jax.random.PRNGKey(0))
    n_in = config.arguments["n_in"]
    xs = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (STEPS, 1, n_in)), np.float32)
    work = pathlib.Path(tempfile.mkdtemp())
    export_model(model, config, work / "art", platforms=["cpu"], static_shapes=[(1, STEPS)])
    compile_artifact(work / "art", ["llvm-cpu"])
    artifact = load(work / "art")
    manifest = artifact.manifest

    # 1. the Python model, jitted, its fixed cache donated
    step = jax.jit(lambda m, x, c: m.step(x, c), donate_argnums=2)
    python_start = model.init_cache(STEPS, on_overflow="nan")
    rows = [jnp.asarray(x[0]) for x in xs]

    def python_stream():
        cache = jax.tree.map(jnp.copy, python_start)
        for x in rows:
            y, cache = step(model, x, cache)
        return y

    # 2. the exported step through the loader (input checks included)
    def loaded_stream():
        cache = artifact.init_cache(1)
        for x in xs:
            y, cache, _ = artifact.step(x, cache)
        return y

    # 3. the IREE module through IREE's runtime; weights and cache stay on the device
    entry = next(e for e in manifest["static"] if e["function"] == "step")
    vmfb = next(c["file"] for c in manifest["compiled"] if c["module"] == entry["bytecode"])
    inputs = [i["name"] for i in manifest["functions"]["step"]["inputs"]]
    kept = entry["kept_inputs"]
    start_cache = [np.asarray(c) for c in artifact.init_cache(1)]

    def iree_stream_on(driver: str):
        """IREE's runtime on `driver`: `local-sync` runs the dispatches on the calling thread,
        `local-task` hands them to a thread pool."""
        iree_config = ireert.Config(driver)
        context = ireert.SystemContext(config=iree_config)
        vm_module = ireert.VmModule.mmap(iree_config.vm_instance, str(work / "art" / vmfb))
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

    iree_sync, iree_task = iree_stream_on("local-sync"), iree_stream_on("local-task")

    # the three agree
    expected = np.asarray(python_stream())
    for other in (loaded_stream(), iree_sync(), iree_task()):
        np.testing.assert_allclose(np.asarray(other)[0], expected, atol=1e-4)

    medians = interleaved(
        {
            "jitted Python step": python_stream,
            "export.load step": loaded_stream,
            "IREE runtime, llvm-cpu, local-sync": iree_sync,
            "IREE runtime, llvm-cpu, local-task": iree_task,
        },
        rounds=40,
    )
    per_step = {name: seconds / STEPS for name, seconds in medians.items()}
    lines = [
        table(
            f"cached step of the digits model, B=1, per step ({len(inputs)} inputs, "
            f"{len(kept)} kept by the static module)",
            per_step,
            "jitted Python step",
        )
    ]

    # What one jitted Python step spends: dispatch of the pytree against the compiled call.
    compiled = step.lower(model, rows[0], python_start).compile()
    flat_args = jax.tree.leaves((model, rows[0], python_start))
    n = 200
    cache = jax.tree.map(jnp.copy, python_start)
    started = time.perf_counter()
    for _ in range(n):
        y, cache = compiled(model, rows[0], cache)
        jax.block_until_ready(y)
    compiled_us = (time.perf_counter() - started) / n * 1e6
    lines.append(
        f"  one jitted step: {len(flat_args)} array arguments flattened and dispatched; through "
        f"the AOT-compiled executable {compiled_us:.0f} us per step (dispatch, not arithmetic: "
        f"the step is a few thousand flops)"
    )
    return "\n".join(lines)
