"""The data-parallel runs of tests/test_distributed.py, as a script (its own JAX process).

    python worker.py MODE OUT_JSON WORK_DIR

MODE "all" (run with 4 forced host devices) trains the same small model in one process:
"single" (no mesh, one device), "mesh" (every device), "fsdp" (mesh, sharded parameters); moves
checkpoints between 4 devices and 1 ("a": 4 steps on the mesh, resumed to 8 without one; "b": 4
steps without a mesh, resumed to 8 with sharded parameters); and exports the FSDP-trained model
and a single-device copy of it, comparing the files. One process compiles the shared pieces once.

MODE "multi" joins a multi-process run from the DENSE_ARMOR_* variables first, then trains on the
mesh of every device of every process, checkpointing into WORK_DIR/ckpt.

Writes `{run name: {devices, processes, train_loss, valid_loss, weight_sum}, ...}` as JSON to
OUT_JSON.<process index>.
"""

import json
import pathlib
import sys

mode, out, work = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])

if mode == "multi":
    from dense_armor.distributed import initialize

    initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dense_armor import training  # noqa: E402
from dense_armor.checkpoint import ModelConfig, fill_tree, tree_arrays  # noqa: E402
from dense_armor.distributed import data_mesh, place  # noqa: E402
from dense_armor.training import evaluate, fit  # noqa: E402

CONFIG = ModelConfig(
    "transformer_encoder",
    {
        "n_in": 3,
        "d_model": 16,
        "n_heads": 2,
        "d_ff": 32,
        "depth": 1,
        "n_out": 2,
        "max_len": 6,
        "causal": True,
        "dropout": 0.1,
    },
)
rng = np.random.default_rng(0)
xs = rng.normal(size=(64, 6, 3)).astype(np.float32)
labels = (xs[:, :, 0].sum(axis=1) > 0).astype(np.int32)


def train(placement: str, steps: int = 8, checkpoint_dir: pathlib.Path | None = None):
    """`fit` with no mesh ("single"), on every device ("mesh"), or with sharded params ("fsdp")."""
    with jax.numpy_dtype_promotion("standard"):
        return fit(
            CONFIG.build(jax.random.PRNGKey(0)),
            optax.adam(3e-3),
            (xs[:48], labels[:48]),
            steps=steps,
            batch_size=16,
            seed=1,
            valid=(xs[48:], labels[48:]),
            eval_every=2,
            checkpoint_dir=checkpoint_dir,
            config=CONFIG if checkpoint_dir else None,
            progress=False,
            mesh=None if placement == "single" else data_mesh(),
            shard_params=placement == "fsdp",
        )


def evaluated(model, mesh) -> dict:
    """`evaluate` on the 16 validation rows in batches of 7 (with 4 devices: 4 rows split and 3
    replicated, twice, then 2 replicated), and the row counts each device got of the split parts."""
    shards = []

    def recording(mesh, rows):
        array = split(mesh, rows)
        shards.append([s.data.shape[0] for s in array.addressable_shards])
        return array

    split, training.global_batch = training.global_batch, recording
    try:
        metrics = evaluate(model, xs[48:], labels[48:], batch_size=7, mesh=mesh)
    finally:
        training.global_batch = split
    return {**metrics, "shards": shards}


def summary(result) -> dict:
    weights = tree_arrays(result.model)
    leaf = next(x for x in jax.tree.leaves(result.model) if isinstance(x, jax.Array))
    return {
        "devices": len(leaf.sharding.device_set),
        "processes": jax.process_count(),
        "train_loss": [r["train_loss"] for r in result.history],
        "valid_loss": [r["valid_loss"] for r in result.history],
        "weight_sum": float(sum(np.abs(w).sum() for w in weights.values())),
        "evaluate": evaluated(
            result.model, None if len(leaf.sharding.device_set) == 1 else data_mesh()
        ),
    }


def identical_exports(model) -> bool:
    """The export of a sharded model is byte for byte that of its single-device copy."""
    from dense_armor.export import export_model

    host_copy = fill_tree(CONFIG.build(), tree_arrays(model))
    for name, m in (("sharded", model), ("single", host_copy)):
        export_model(m, CONFIG, work / name, platforms=["cpu"], static_shapes=[(2, 6)])
    files = sorted(p.relative_to(work / "sharded") for p in (work / "sharded").rglob("*.*"))
    return len(files) > 5 and all(
        (work / "sharded" / f).read_bytes() == (work / "single" / f).read_bytes() for f in files
    )


runs = {}
if mode == "multi":
    runs["multi"] = summary(train("mesh", checkpoint_dir=work / "ckpt"))
else:
    assert jax.device_count() == 4, "run with --xla_force_host_platform_device_count=4"
    single = train("single")
    runs["single"] = summary(single)
    # The same model, evaluated with its batches split over the 4 devices.
    runs["single, evaluated on 4"] = evaluated(place(single.model, data_mesh()), data_mesh())
    runs["mesh"] = summary(train("mesh"))
    fsdp = train("fsdp")
    runs["fsdp"] = {**summary(fsdp), "identical_exports": identical_exports(fsdp.model)}
    train("mesh", steps=4, checkpoint_dir=work / "a")
    runs["a: 4 devices, resumed on 1"] = summary(train("single", checkpoint_dir=work / "a"))
    train("single", steps=4, checkpoint_dir=work / "b")
    runs["b: 1 device, resumed on 4"] = summary(train("fsdp", checkpoint_dir=work / "b"))
with open(f"{out}.{jax.process_index()}", "w") as handle:
    json.dump(runs, handle)
