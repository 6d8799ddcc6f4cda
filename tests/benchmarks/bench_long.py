"""Long sequences: one Transformer block at T = 4096, 8192 and 16384 (d_model=256, 8 heads,
d_ff=1024, batch 1, float32), forward and forward+backward, wall time and peak memory.

Systems: dense_armor with its blocked attention (`memory_efficient=True`, what `None` picks at
these lengths), dense_armor with the `(T, T)` scores materialised (`memory_efficient=False`) and
the same block from `equinox.nn.MultiheadAttention/LayerNorm/Linear`.

Each measurement runs in a subprocess of its own, which reports its peak resident set size
(`VmHWM`, the whole process: Python, JAX and XLA included) next to its times. Before running,
a child asks XLA for the compiled function's buffer sizes (`memory_analysis`); a function that
would need more than `MEMORY_LIMIT` of temporaries is reported with that figure and not run, so
the benchmark never drives the machine out of memory. Systems alternate (A B C A B C) across
`ROUNDS` rounds of subprocesses; the time is the median over every timed call.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from dense_armor.utility.neural import TransformerBlock

D_MODEL, HEADS, D_FF = 256, 8, 1024
LENGTHS = (4096, 8192, 16384)
SYSTEMS = ("dense_armor blocked", "dense_armor materialised", "equinox")
MODES = ("forward", "forward+backward")
ROUNDS, CALLS = 2, 1
MEMORY_LIMIT = 12 * 2**30
GiB = 2**30


class EquinoxBlock(eqx.Module):
    """The same post-LN block from Equinox's layers (no attention biases, ReLU feed-forward)."""

    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm

    def __init__(self, key: jax.Array):
        akey, hkey, okey = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(HEADS, D_MODEL, key=akey)
        self.norm1 = eqx.nn.LayerNorm(D_MODEL)
        self.hidden = eqx.nn.Linear(D_MODEL, D_FF, key=hkey)
        self.out = eqx.nn.Linear(D_FF, D_MODEL, key=okey)
        self.norm2 = eqx.nn.LayerNorm(D_MODEL)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.norm1)(x + self.attention(x, x, x))
        ff = jax.vmap(self.out)(jax.nn.relu(jax.vmap(self.hidden)(h)))
        return jax.vmap(self.norm2)(h + ff)


def _child(system: str, length: int, mode: str) -> dict:
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(jax.random.PRNGKey(1), (length, D_MODEL))
    if system == "equinox":
        model = EquinoxBlock(key)
    else:
        blocked = system == "dense_armor blocked"
        model = TransformerBlock(D_MODEL, HEADS, D_FF, key, memory_efficient=blocked)

    params, static = eqx.partition(model, eqx.is_array)

    def forward(p: eqx.Module, x: jax.Array) -> jax.Array:
        return eqx.combine(p, static)(x)

    def loss(p: eqx.Module, x: jax.Array) -> jax.Array:
        return jnp.mean(forward(p, x) ** 2)

    fn = jax.jit(forward if mode == "forward" else jax.value_and_grad(loss, argnums=(0, 1)))
    compiled = fn.lower(params, x).compile()
    analysis = compiled.memory_analysis()
    temp = int(getattr(analysis, "temp_size_in_bytes", 0)) if analysis is not None else 0
    result: dict = {"xla_temp_bytes": temp}
    if temp > MEMORY_LIMIT:
        result["skipped"] = True
        return result
    jax.block_until_ready(compiled(params, x))
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - start)
    result["times"] = times
    result["peak_rss_bytes"] = _peak_rss_bytes()
    return result


def _peak_rss_bytes() -> int:
    """This process's peak resident set size. Read from `VmHWM`, which belongs to the process's
    own memory map: `ru_maxrss` would also carry the parent's peak across fork and exec."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure(system: str, length: int, mode: str) -> dict:
    command = [sys.executable, "-m", "tests.benchmarks.bench_long", system, str(length), mode]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(results: list[dict]) -> tuple[str, str]:
    first = results[0]
    if "error" in first:
        return "failed", first["error"][:40]
    if first.get("skipped"):
        need = first["xla_temp_bytes"] / GiB
        return "not run", f"XLA needs {need:.1f} GiB"
    times = [t for r in results for t in r["times"]]
    peak = max(r["peak_rss_bytes"] for r in results) / GiB
    return f"{statistics.median(times) * 1e3:.0f}", f"{peak:.2f} GiB"


def run() -> str:
    lines = [
        "\nLong sequences: one block, d_model=256, 8 heads, d_ff=1024, batch 1 (time in ms, peak"
        " RSS of the whole process)",
        f"{'T':>6}  {'mode':<17}{'system':<27}{'median ms':>10}   {'peak memory':<20}"
        "time / blocked",
    ]
    for length in LENGTHS:
        for mode in MODES:
            runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
            for _ in range(ROUNDS):
                for name in SYSTEMS:
                    if runs[name] and ("error" in runs[name][0] or runs[name][0].get("skipped")):
                        continue
                    runs[name].append(_measure(name, length, mode))
            cells = {name: _cell(results) for name, results in runs.items()}
            reference = cells["dense_armor blocked"][0]
            for name, (ms, memory) in cells.items():
                ratio = ""
                if ms.isdigit() and reference.isdigit():
                    ratio = f"{int(ms) / int(reference):.2f}x"
                lines.append(f"{length:>6}  {mode:<17}{name:<27}{ms:>10}   {memory:<20}{ratio}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        print(json.dumps(_child(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
    else:
        print(run())
