"""The data-parallel runs of tests/test_distributed.py, as a script (its own JAX process).

    python worker.py MODE OUT_JSON WORK_DIR

MODE "all" (run with 4 forced host devices) trains the same small model in one process:
"single" (no mesh, one device), "mesh" (every device), "fsdp" (mesh, sharded parameters); moves
checkpoints between 4 devices and 1 ("a": 4 steps on the mesh, resumed to 8 without one; "b": 4
steps without a mesh, resumed to 8 with sharded parameters); and exports the FSDP-trained model
and a single-device copy of it, comparing the files. One process compiles the shared pieces once.

The 2-D mesh runs: "tp" (2 x 2, data x model: heads and feed-forward units split over "model"),
"tp+fsdp" (the same with sharded parameters); sharded Orbax checkpoints written on 2 x 2 and
resumed on one device and on 4 x 1; "halves" trains from two `ShardSource`s, one per half of the
data, concatenated (what two processes, each holding one half, feed together).

MODE "multi" joins a multi-process run from the DENSE_ARMOR_* variables first, then trains on the
mesh of every device of every process, checkpointing into WORK_DIR/ckpt ("multi"), then
on the 2 x 2 mesh with each process reading only its half of the data (a `ShardSource`), with
sharded Orbax checkpoints in WORK_DIR/orbax ("multi-halves"): one pair of processes starts,
joins and imports once for both.

Writes `{run name: {devices, processes, train_loss, valid_loss, weight_sum}, ...}` as JSON to
OUT_JSON.<process index>.
"""

import json
import pathlib
import shutil
import sys
import warnings

mode, out, work = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])

if mode.startswith("multi"):
    from dense_armor.distributed import initialize

    initialize()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dense_armor.checkpoints import ModelConfig, fill_tree, tree_arrays  # noqa: E402
from dense_armor.distributed import data_mesh, device_mesh, place  # noqa: E402
from dense_armor.training import (  # noqa: E402
    ShardSource,
    evaluate,
    fit,
    next_token_loss,
)
from dense_armor.training import step as train_step  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from environment import collect_garbage_less_often, share_one_mlir_context  # noqa: E402

collect_garbage_less_often()
share_one_mlir_context()

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


MESHES = {
    "single": lambda: None,
    "mesh": data_mesh,
    "fsdp": data_mesh,
    "tp": lambda: device_mesh(model=2),
    "tp+fsdp": lambda: device_mesh(model=2),
    "4x1": lambda: device_mesh(model=1),
}


def train(
    placement: str,
    steps: int = 8,
    checkpoint_dir: pathlib.Path | None = None,
    data=None,
    checkpoint_format: str = "safetensors",
):
    """`fit` with no mesh ("single"), on every device ("mesh"), with sharded params ("fsdp"), on
    the 2 x 2 mesh ("tp", "tp+fsdp") or on 4 x 1."""
    with jax.numpy_dtype_promotion("standard"):
        return fit(
            CONFIG.build(jax.random.PRNGKey(0)),
            optax.adam(3e-3),
            (xs[:48], labels[:48]) if data is None else data,
            steps=steps,
            batch_size=16,
            seed=1,
            valid=(xs[48:], labels[48:]),
            eval_every=2,
            checkpoint_dir=checkpoint_dir,
            config=CONFIG if checkpoint_dir else None,
            progress=False,
            mesh=MESHES[placement](),
            shard_params=placement.endswith("fsdp"),
            checkpoint_format=checkpoint_format,
        )


class Recorded:
    """A `ShardSource` over rows `first..first+24` of the training data that records the rows it
    hands out (as indices into the whole data)."""

    def __init__(self, half: int, rows: int = 8):
        self.first = 24 * half
        part = slice(self.first, self.first + 24)
        self.source = ShardSource(xs[part], labels[part], rows, seed=1, part=half)
        self.read: set[int] = set()

    def __call__(self, step):
        batch_xs, batch_labels = self.source(step)
        for row in batch_xs:
            self.read.add(int(np.flatnonzero((xs == row).all(axis=(1, 2)))[0]))
        return batch_xs, batch_labels


def both_halves(step):
    """What two processes, each with its own half, feed together: half 0's rows, then half 1's."""
    parts = [Recorded(half)(step) for half in (0, 1)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def head_split(model) -> dict:
    """For each head-split matrix of the first block: the fraction of it each device holds."""
    block = model.layers[2]
    arrays = {
        "W_Q": block.attention.W_Q.value,
        "W_K": block.attention.W_K.value,
        "W_V": block.attention.W_V.value,
        "W_O": block.attention.W_O.value,
        "W_1": block.feed_forward.hidden.W.value,
        "W_2": block.feed_forward.out.W.value,
    }
    return {
        name: sorted({s.data.size / a.size for s in a.addressable_shards})
        for name, a in arrays.items()
    }


def evaluated(model, mesh) -> dict:
    """`evaluate` on the 16 validation rows in batches of 7 (with 4 devices: 4 rows split and 3
    replicated, twice, then 2 replicated), and the row counts each device got of the split parts."""
    shards = []

    def recording(mesh, rows):
        array = split(mesh, rows)
        shards.append([s.data.shape[0] for s in array.addressable_shards])
        return array

    split, train_step.global_batch = train_step.global_batch, recording
    try:
        metrics = evaluate(model, xs[48:], labels[48:], batch_size=7, mesh=mesh)
    finally:
        train_step.global_batch = split
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


LM_CONFIG = ModelConfig(
    "transformer_lm",
    {"vocab": 16, "d_model": 16, "n_heads": 4, "d_ff": 32, "depth": 2, "max_len": 16},
)


def train_lm(placement: str) -> dict:
    """A language model (rotary positions, GQA, SwiGLU, tied head) on next tokens, with no mesh
    or on the 2 x 2 mesh with sharded params: its losses, and the fraction of the first block's
    query projection and of the token table that each device holds."""
    text = np.tile(np.arange(3, 11), 8)
    windows = np.stack([text[i : i + 13] for i in range(32)])
    with jax.numpy_dtype_promotion("standard"):
        result = fit(
            LM_CONFIG.build(jax.random.PRNGKey(0)),
            optax.adam(1e-2),
            (windows[:, :-1], windows[:, 1:]),
            steps=6,
            batch_size=8,
            seed=1,
            loss_fn=next_token_loss,
            progress=False,
            eval_every=3,
            mesh=MESHES[placement](),
            shard_params=placement.endswith("fsdp"),
        )
    model = result.model
    return {
        "train_loss": [r["train_loss"] for r in result.history],
        "split": {
            name: sorted({s.data.size / a.size for s in a.addressable_shards})
            for name, a in (
                ("W_Q", model.blocks[0].attention.W_Q.value),
                ("table", model.embed.table.value),
            )
        },
    }


def reported() -> dict:
    """What is reported rather than done in silence: FSDP's arrays that no axis of which the 4
    devices divide (a warning), and heads that a "model" axis of 4 cannot split (an error)."""
    from dense_armor.distributed import ShardingWarning, partition_specs

    model = CONFIG.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        partition_specs(model, data_mesh(), shard_params=True)
    try:
        partition_specs(model, device_mesh(model=4))
        error = None
    except ValueError as raised:
        error = str(raised)
    return {
        "warnings": [str(w.message) for w in caught if w.category is ShardingWarning],
        "heads over 4": error,
    }


def micro_batches() -> dict:
    """How many micro-batches `make_train_step` chooses, with its CPU budget lowered to one byte
    (any step exceeds it), for a batch on one device and for the batch split over the 4."""
    from dense_armor.distributed import global_batch

    model = CONFIG.build()
    optimizer = optax.adam(1e-3)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = train_step.make_train_step(optimizer)
    budget, train_step.CPU_STEP_BYTES = train_step.CPU_STEP_BYTES, 1
    try:
        one = step.micro_batches(model, state, jax.numpy.asarray(xs[:8]), labels[:8])
        mesh = data_mesh()
        split = global_batch(mesh, xs[:8]), global_batch(mesh, labels[:8])
        return {"one device": one, "split over 4": step.micro_batches(model, state, *split)}
    finally:
        train_step.CPU_STEP_BYTES = budget


runs = {}
if mode == "multi":  # both two-process runs, in one pair of processes
    runs["multi"] = summary(train("mesh", checkpoint_dir=work / "ckpt"))
    mine = Recorded(jax.process_index())
    result = train("tp", data=mine, checkpoint_dir=work / "orbax", checkpoint_format="orbax")
    runs["multi-halves"] = {
        **summary(result),
        "read": sorted(mine.read),
        "head_split": head_split(result.model),
    }
else:
    assert jax.device_count() == 4, "run with --xla_force_host_platform_device_count=4"
    single = train("single")
    runs["single"] = summary(single)
    # The same model, evaluated with its batches split over the 4 devices.
    runs["single, evaluated on 4"] = evaluated(place(single.model, data_mesh()), data_mesh())
    runs["mesh"] = summary(train("mesh"))
    fsdp = train("fsdp")
    runs["fsdp"] = {**summary(fsdp), "identical_exports": identical_exports(fsdp.model)}
    for placement in ("tp", "tp+fsdp"):
        result = train(placement)
        runs[placement] = {**summary(result), "head_split": head_split(result.model)}
    train("mesh", steps=4, checkpoint_dir=work / "a")
    runs["a: 4 devices, resumed on 1"] = summary(train("single", checkpoint_dir=work / "a"))
    train("single", steps=4, checkpoint_dir=work / "b")
    runs["b: 1 device, resumed on 4"] = summary(train("fsdp", checkpoint_dir=work / "b"))
    # Sharded (Orbax) checkpoints written on 2 x 2, resumed on one device and on 4 x 1.
    train("tp", steps=4, checkpoint_dir=work / "o", checkpoint_format="orbax")
    shutil.copytree(work / "o", work / "o41")
    runs["orbax: 2x2, resumed on 1"] = summary(
        train("single", checkpoint_dir=work / "o", checkpoint_format="orbax")
    )
    runs["orbax: 2x2, resumed on 4x1"] = summary(
        train("4x1", checkpoint_dir=work / "o41", checkpoint_format="orbax")
    )
    runs["halves"] = summary(train("single", data=both_halves))
    runs["reported"] = reported()
    runs["micro-batches"] = micro_batches()
    runs["lm single"], runs["lm tp+fsdp"] = train_lm("single"), train_lm("tp+fsdp")
with open(f"{out}.{jax.process_index()}", "w") as handle:
    json.dump(runs, handle)
