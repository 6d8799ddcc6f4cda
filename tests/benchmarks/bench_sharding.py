"""Per-device bytes of parameters plus optimizer state, from XLA's memory analysis of the compiled
training step, on 1, 2 and 4 devices: data parallel (replicated), FSDP (`shard_params=True`),
tensor parallel (heads and feed-forward units over `"model"`) and both (2 x 2: model 2, FSDP on
data).

And for generation over `"model"` (`Server(mesh=)`): per-device bytes of a language model's
weights and of its caches (every slot's whole cache; a paged server's pools), on 1, 2 and 4
devices. Goal: about 1/N (the embedding table and the norms stay whole).

The forced host devices must be set before JAX starts, so the measurement runs in a child
process (`python -m tests.benchmarks.bench_sharding --child`). Goal: 1/N for the sharded ones.
"""

import json
import os
import subprocess
import sys

D_MODEL, N_HEADS, D_FF, DEPTH, T = 256, 8, 1024, 4, 64
# name -> (the "model" axis on N devices, shard_params)
PLACEMENTS = {
    "data parallel": (lambda n: 1, False),
    "FSDP": (lambda n: 1, True),
    "tensor parallel": (lambda n: n, False),
    "both (model 2, FSDP on data)": (lambda n: min(n, 2), True),
}


def measure() -> dict[str, dict[int, int]]:
    import warnings

    import equinox as eqx
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dense_armor.distributed import (
        ShardingWarning,
        device_mesh,
        place,
        place_optimizer_state,
    )
    from dense_armor.training import make_train_step
    from dense_armor.utility.neural import transformer_encoder

    warnings.simplefilter("ignore", ShardingWarning)  # the table shows what stays whole
    optimizer = optax.adam(1e-3)
    step = make_train_step(optimizer, accumulate=1)  # the one jitted step: `.lower`
    model = transformer_encoder(
        16, D_MODEL, N_HEADS, D_FF, DEPTH, 10, jax.random.PRNGKey(0), max_len=T
    )
    out: dict[str, dict[int, int]] = {}
    for name, (model_axis, shard) in PLACEMENTS.items():
        out[name] = {}
        for n in (1, 2, 4):
            mesh = device_mesh(model=model_axis(n), devices=jax.devices()[:n])
            placed = place(model, mesh, shard)
            opt_state = place_optimizer_state(
                optimizer.init(eqx.filter(placed, eqx.is_inexact_array)), optimizer, placed, mesh
            )
            rows = mesh.shape["data"]
            batch = NamedSharding(mesh, P("data"))
            xs = jax.device_put(np.zeros((rows, T, 16), np.float32), batch)
            labels = jax.device_put(np.zeros((rows,), np.int32), batch)
            with jax.numpy_dtype_promotion("standard"):
                compiled = step.lower(placed, opt_state, xs, labels, jax.random.PRNGKey(0))
                analysis = compiled.lowered.compile().memory_analysis()
            batch_bytes = T * 16 * 4 + 4 + 8  # one row of inputs and its label, and the key
            out[name][n] = int(analysis.argument_size_in_bytes) - batch_bytes
    return out


# generation: a small Llama-shaped model (grouped key/value heads that 1, 2 and 4 divide)
LM = dict(vocab=4096, d_model=512, n_heads=8, d_ff=1408, depth=4, max_len=512, n_kv_heads=4)
SLOTS, CAPACITY = 8, 256


def _on_first_device(tree: object) -> int:
    import jax

    first = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
        for shard in leaf.addressable_shards
        if shard.device == first
    )


def measure_generation() -> dict[str, dict[int, int]]:
    """Device 0's bytes of the weights and of the caches of servers on 1, 2 and 4 devices."""
    import jax

    from dense_armor.distributed import device_mesh
    from dense_armor.nn.models.language_model import TransformerLM
    from dense_armor.serving import Server

    model = TransformerLM(**LM, key=jax.random.PRNGKey(0))
    out: dict[str, dict[int, int]] = {"weights": {}, "fixed cache": {}, "paged pools": {}}
    for n in (1, 2, 4):
        mesh = device_mesh(model=n, devices=jax.devices()[:n])
        fixed = Server(model, SLOTS, CAPACITY, mesh=mesh)
        paged = Server(
            model, SLOTS, CAPACITY, mesh=mesh, pages=SLOTS * CAPACITY // 32, page_size=16
        )
        out["weights"][n] = _on_first_device(fixed.model)
        out["fixed cache"][n] = _on_first_device(fixed.caches)
        out["paged pools"][n] = _on_first_device(paged.caches)
    return out


def _table(title: str, first: str, figures: dict) -> list[str]:
    lines = [title, f"{first:<32}{'1 device':>12}{'2 devices':>12}{'4 devices':>12}   4 / 1"]
    for name, by_n in figures.items():
        one = by_n["1"]
        cells = "".join(f"{by_n[str(n)] / 2**20:>10.2f}Mi" for n in (1, 2, 4))
        lines.append(f"{name:<32}{cells}   {by_n['4'] / one:.3f}")
    return lines


def run() -> str:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    child = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.bench_sharding", "--child"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    training, generation = json.loads(child.stdout.strip().splitlines()[-1])
    lines = _table(
        f"\nPer-device bytes of parameters + Adam state (XLA memory analysis of the train step), "
        f"d_model {D_MODEL}, {N_HEADS} heads, d_ff {D_FF}, depth {DEPTH}",
        "placement",
        training,
    )
    lines += _table(
        f'\nGeneration over "model": device 0\'s bytes, {LM} in float32, Server(slots={SLOTS}, '
        f"capacity={CAPACITY}), paged: {SLOTS * CAPACITY // 32} pages of 16",
        "",
        generation,
    )
    return "\n".join(lines)


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps([measure(), measure_generation()]))
    else:
        print(run())
