"""One process of a data-parallel run, for tests/test_distributed.py (run as a script).

    python worker.py MODE OUT_JSON CHECKPOINT_DIR|- STEPS

MODE: "single" (no mesh), "mesh" (every local device), "fsdp" (mesh with sharded parameters),
"multi" (join a multi-process run from DENSE_ARMOR_* variables first, then "mesh"), "export"
("fsdp", then export the sharded model and a single-device copy of it, and compare the files).
Each process writes its losses (and the final weights' checksum) as JSON to OUT_JSON.<process>.
"""

import json
import sys

mode, out = sys.argv[1], sys.argv[2]
checkpoint_dir = None if sys.argv[3] == "-" else sys.argv[3]
steps = int(sys.argv[4])

if mode == "multi":
    from dense_armor.distributed import initialize

    initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dense_armor.checkpoint import ModelConfig, tree_arrays  # noqa: E402
from dense_armor.distributed import data_mesh  # noqa: E402
from dense_armor.training import fit  # noqa: E402

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

with jax.numpy_dtype_promotion("standard"):
    result = fit(
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
        mesh=None if mode == "single" else data_mesh(),
        shard_params=mode in ("fsdp", "export"),
    )
weights = tree_arrays(result.model)
identical = None
if mode == "export":
    import pathlib
    import tempfile

    from dense_armor.checkpoint import fill_tree
    from dense_armor.export import export_model

    base = pathlib.Path(tempfile.mkdtemp())
    host_copy = fill_tree(CONFIG.build(), weights)
    for name, model in (("sharded", result.model), ("single", host_copy)):
        export_model(model, CONFIG, base / name, platforms=["cpu"], static_shapes=[(2, 6)])
    files = sorted(p.relative_to(base / "sharded") for p in (base / "sharded").rglob("*.*"))
    identical = len(files) > 5 and all(
        (base / "sharded" / f).read_bytes() == (base / "single" / f).read_bytes() for f in files
    )
with open(f"{out}.{jax.process_index()}", "w") as handle:
    json.dump(
        {
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "train_loss": [r["train_loss"] for r in result.history],
            "valid_loss": [r["valid_loss"] for r in result.history],
            "weight_sum": float(sum(np.abs(w).sum() for w in weights.values())),
            "identical_exports": identical,
        },
        handle,
    )
