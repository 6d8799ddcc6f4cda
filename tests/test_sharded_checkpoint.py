"""Sharded checkpoints with Orbax on one device, and the data sources of `fit`. The meshes (save on
2 x 2, restore on one device and on 4 x 1, two processes writing their own shards) are in
test_distributed.py."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from dense_armor.checkpoints import ModelConfig, load_checkpoint, tree_arrays
from dense_armor.checkpoints.sharded import ShardedCheckpoints, from_safetensors, to_safetensors
from dense_armor.training import ArraySource, ShardSource, fit, make_train_step, process_rows

pytestmark = pytest.mark.optax

CONFIG = ModelConfig(
    "transformer_encoder",
    {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "n_out": 2, "max_len": 6,
     "causal": True, "dropout": 0.1},
)  # fmt: skip
rng = np.random.default_rng(0)
XS = rng.normal(size=(40, 6, 3)).astype(np.float32)
LABELS = (XS[:, :, 0].sum(axis=1) > 0).astype(np.int32)
ADAM = optax.adam(3e-3)


def train(steps, checkpoint_dir=None, checkpoint_format="safetensors", data=None):
    return fit(
        CONFIG.build(jax.random.PRNGKey(0)),
        ADAM,
        (XS[:32], LABELS[:32]) if data is None else data,
        steps=steps,
        batch_size=8,
        seed=3,
        valid=(XS[32:], LABELS[32:]),
        eval_every=2,
        checkpoint_dir=checkpoint_dir,
        config=CONFIG if checkpoint_dir else None,
        progress=False,
        checkpoint_format=checkpoint_format,
    )


@pytest.fixture(scope="module")
def uninterrupted():
    return train(8)


def same_run(a, b):
    assert [r["step"] for r in a.history] == [r["step"] for r in b.history]
    for key in ("train_loss", "valid_loss"):
        np.testing.assert_allclose(
            [r[key] for r in a.history], [r[key] for r in b.history], rtol=1e-6
        )
    for path, array in tree_arrays(a.model).items():
        np.testing.assert_allclose(tree_arrays(b.model)[path], array, rtol=1e-6, atol=1e-7)


def test_a_model_and_its_optimizer_state_come_back_exactly(tmp_path):
    model = CONFIG.build(jax.random.PRNGKey(1))
    opt_state = ADAM.init(eqx.filter(model, eqx.is_inexact_array))
    model, opt_state, _ = make_train_step(ADAM)(
        model, opt_state, XS[:4], LABELS[:4], jax.random.PRNGKey(2)
    )  # moments that are not zeros
    with ShardedCheckpoints(tmp_path / "s") as store:  # asynchronous
        store.save(7, model, CONFIG, opt_state=opt_state, state={"step": 7, "note": "x"})
        back = store.restore(optimizer=ADAM)
    assert back.step == 7 and back.config == CONFIG and back.state == {"step": 7, "note": "x"}
    assert type(back.model) is type(model)
    for path, array in tree_arrays(model).items():
        np.testing.assert_array_equal(tree_arrays(back.model)[path], array)
    assert jax.tree.structure(back.opt_state) == jax.tree.structure(opt_state)
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(back.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    # the restored model runs
    assert back.model(XS[0]).shape == (2,)


def test_the_latest_step_and_the_best_are_kept(tmp_path):
    model = CONFIG.build()
    scores = {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.6}
    with ShardedCheckpoints(tmp_path / "best", keep_best=True) as store:
        for step, score in scores.items():
            store.save(step, model, CONFIG, score=score)
        assert store.steps() == [2, 4] and store.best_step() == 2 and store.latest_step() == 4
    with ShardedCheckpoints(tmp_path / "latest", max_to_keep=2) as store:
        for step in scores:
            store.save(step, model, CONFIG)
        assert store.steps() == [3, 4] and store.best_step() is None


def test_fit_resumes_from_a_sharded_checkpoint_exactly(tmp_path, uninterrupted):
    train(4, tmp_path, "orbax")
    store = ShardedCheckpoints(tmp_path / "sharded")
    assert store.latest_step() == 4
    same_run(train(8, tmp_path, "orbax"), uninterrupted)


def test_checkpoints_convert_both_ways_and_resume_exactly(tmp_path, uninterrupted):
    """4 steps saved sharded, converted to the single file, resumed from it to 8; and 4 steps
    saved as the single file, converted to sharded, resumed from that: the uninterrupted run."""
    train(4, tmp_path / "a", "orbax")
    to_safetensors(tmp_path / "a" / "sharded", tmp_path / "b" / "last", optimizer=ADAM)
    single = load_checkpoint(tmp_path / "b" / "last")
    assert single.config == CONFIG and single.state["step"] == 4 and single.state_arrays
    same_run(train(8, tmp_path / "b"), uninterrupted)

    train(4, tmp_path / "c")
    assert (
        from_safetensors(tmp_path / "c" / "last", tmp_path / "d" / "sharded", optimizer=ADAM) == 4
    )
    same_run(train(8, tmp_path / "d", "orbax"), uninterrupted)


def test_resume_false_starts_a_sharded_run_over(tmp_path):
    train(4, tmp_path, "orbax")
    again = fit(
        CONFIG.build(jax.random.PRNGKey(0)), ADAM, (XS[:32], LABELS[:32]), steps=2, batch_size=8,
        seed=3, checkpoint_dir=tmp_path, config=CONFIG, progress=False, resume=False,
        checkpoint_format="orbax", eval_every=2,
    )  # fmt: skip
    assert [r["step"] for r in again.history] == [2]
    assert ShardedCheckpoints(tmp_path / "sharded").steps() == [2]


TRUNCATED = """
import pathlib, sys
from dense_armor.checkpoints import CheckpointError, ModelConfig
from dense_armor.checkpoints.sharded import ShardedCheckpoints
config = ModelConfig.from_json({"format": "dense_armor.checkpoint", "version": 1,
    "factory": "transformer_encoder", "arguments": %r})
root = pathlib.Path(sys.argv[1])
with ShardedCheckpoints(root, asynchronous=False) as store:
    store.save(1, config.build(), config)
for data in root.rglob("d/*"):
    data.write_bytes(b"")
try:
    ShardedCheckpoints(root).restore()
except CheckpointError as error:
    print("refused:", error)
"""


def test_a_truncated_sharded_checkpoint_is_refused(tmp_path):
    """Its own interpreter: Orbax's reader threads report the failed read once more as they wind
    down, after the error has been raised."""
    import subprocess
    import sys

    from environment import child_env

    script = TRUNCATED % dict(CONFIG.arguments)
    ran = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s")],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )  # fmt: skip
    assert "refused: cannot read the sharded checkpoint of step 1" in ran.stdout, ran.stderr


# Data sources


def test_a_shard_source_reads_each_of_its_rows_once_an_epoch():
    source = ShardSource(XS[:12], LABELS[:12], 4, seed=1, part=0)
    epoch = np.concatenate([source(step)[0] for step in range(3)])
    assert sorted(map(bytes, epoch)) == sorted(map(bytes, XS[:12]))
    # the next epoch is another order, and a step gives the same batch every time it is asked
    assert not np.array_equal(source(3)[0], source(0)[0])
    np.testing.assert_array_equal(source(5)[0], source(5)[0])
    # another part (another process) draws another order from the same seed
    other = ShardSource(XS[:12], LABELS[:12], 4, seed=1, part=1)
    assert not np.array_equal(other(0)[0], source(0)[0])


def test_fit_on_a_source_equals_fit_on_the_arrays(uninterrupted):
    """`train=(xs, labels)` is `ArraySource` over them: passing the source itself trains alike;
    without a mesh a process feeds every row."""
    assert process_rows(None, 8) == slice(0, 8)
    same_run(train(8, data=ArraySource(XS[:32], LABELS[:32], 8, seed=3)), uninterrupted)


# Placement on a mesh, in this process (one device: a 1 x 1 mesh)


def test_fit_on_a_mesh_saves_sharded_and_resumes_exactly(tmp_path, uninterrupted):
    from dense_armor.distributed import device_mesh

    def on_mesh(steps):
        return fit(
            CONFIG.build(jax.random.PRNGKey(0)), ADAM, (XS[:32], LABELS[:32]), steps=steps,
            batch_size=8, seed=3, valid=(XS[32:], LABELS[32:]), eval_every=2,
            checkpoint_dir=tmp_path, config=CONFIG, progress=False, checkpoint_format="orbax",
            mesh=device_mesh(model=1), shard_params=True,
        )  # fmt: skip

    on_mesh(4)
    same_run(on_mesh(8), uninterrupted)


def flat_sgd(rate):
    """An optimizer whose state is one flat vector over every parameter (a per-entry step size),
    which optax cannot map onto the parameter tree."""
    import jax.numpy as jnp

    def init(params):
        return jnp.concatenate([p.ravel() * 0 + rate for p in jax.tree.leaves(params)])

    def update(grads, state, params=None):
        leaves, tree = jax.tree.flatten(grads)
        steps, start = [], 0
        for g in leaves:
            steps.append(-state[start : start + g.size].reshape(g.shape) * g)
            start += g.size
        return jax.tree.unflatten(tree, steps), state

    return optax.GradientTransformation(init, update)


def test_an_optimizer_state_that_cannot_be_mapped_is_replicated_with_a_warning():
    from dense_armor.distributed import ShardingWarning, device_mesh

    with pytest.warns(ShardingWarning, match=r"optimizer state is replicated on every device"):
        result = fit(
            CONFIG.build(), flat_sgd(0.01), (XS[:32], LABELS[:32]), steps=2, batch_size=8,
            mesh=device_mesh(), progress=False,
        )  # fmt: skip
    assert np.isfinite(result.history[-1]["train_loss"])


# A writer killed at any moment loses nothing complete

WRITER = """
import sys
import jax
from dense_armor.checkpoints import ModelConfig
from dense_armor.checkpoints.sharded import ShardedCheckpoints
config = ModelConfig("transformer_encoder", {"n_in": 3, "d_model": 256, "n_heads": 8,
    "d_ff": 1024, "depth": 2, "n_out": 2, "max_len": 6})
model = config.build()
store = ShardedCheckpoints(sys.argv[1], max_to_keep=2)  # asynchronous
for step in range(1, 1000):
    store.save(step, jax.tree.map(lambda a: a + step, model), config)
    print("saved", step, flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.2])
def test_a_writer_killed_mid_save_leaves_the_last_complete_step(tmp_path, delay):
    """SIGKILL while asynchronous saves are being written: the directory opens, its latest
    complete step restores, and holds exactly what was saved as that step."""
    import signal
    import subprocess
    import sys
    import time

    from environment import child_env

    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "s")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env(),
    )  # fmt: skip
    try:
        for line in writer.stdout:
            if line.strip() == "saved 4":
                break
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=60)
        writer.stdout.close()
    with ShardedCheckpoints(tmp_path / "s") as store:
        back = store.restore()
    assert back.step >= 3
    config = back.config
    expected = jax.tree.map(lambda a: a + back.step, config.build())
    for path, array in tree_arrays(expected).items():
        np.testing.assert_array_equal(tree_arrays(back.model)[path], array)
