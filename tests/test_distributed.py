"""Data parallelism on JAX's own engine, on this CPU: 4 forced host devices in one process, and
two processes of two devices each on 127.0.0.1, against the single-device run.

One worker process (tests/distributed/worker.py, mode "all") trains the single-device, mesh and
FSDP runs, moves checkpoints between 4 devices and 1, and compares exports; the two-process run
is the only multi-host proof and runs once.
"""

import json
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from environment import child_env

WORKER = pathlib.Path(__file__).resolve().parent / "distributed" / "worker.py"


def start(mode, work, devices, extra_env=None):
    env = child_env(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **(extra_env or {})
    )
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{mode}.json"
    args = [sys.executable, str(WORKER), mode, str(out), str(work)]
    process = subprocess.Popen(
        args, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return process, out


def result(process_and_out, index=0, timeout=300):
    process, out = process_and_out
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return json.loads(pathlib.Path(f"{out}.{index}").read_text())


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=tol)
    np.testing.assert_allclose(a["valid_loss"], b["valid_loss"], rtol=tol)
    np.testing.assert_allclose(a["weight_sum"], b["weight_sum"], rtol=tol)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return result(start("all", tmp_path_factory.mktemp("all"), devices=4))


def test_the_single_run_uses_one_device_and_learns(runs):
    single = runs["single"]
    assert single["devices"] == 1 and single["processes"] == 1
    assert len(single["train_loss"]) == 4 and single["valid_loss"][-1] < single["valid_loss"][0]


@pytest.mark.parametrize("mode", ["mesh", "fsdp"])
def test_four_devices_match_one(runs, mode):
    assert runs[mode]["devices"] == 4
    close(runs[mode], runs["single"])


def test_a_batch_split_over_devices_is_never_cut_into_micro_batches(runs):
    """`make_train_step`'s automatic micro-batches are for one CPU device: the same batch, with
    the budget at one byte, is cut on one device and left whole when split over the mesh."""
    chosen = runs["micro-batches"]
    assert chosen["one device"] > 1 and 8 % chosen["one device"] == 0
    assert chosen["split over 4"] == 1


def test_evaluate_splits_its_batches_across_the_devices(runs):
    """The same model evaluated on one device and on four: the same metrics, and each batch's
    largest part that 4 divides split one row per device (the rest replicated)."""
    one, four = runs["single"]["evaluate"], runs["single, evaluated on 4"]
    # two split batches, their inputs and their labels
    assert one["shards"] == [] and four["shards"] == [[1, 1, 1, 1]] * 4
    np.testing.assert_allclose(four["loss"], one["loss"], rtol=1e-6)
    assert four["accuracy"] == one["accuracy"]
    # Trained on 4 devices (data parallel, FSDP), evaluated on 4: the single run's metrics.
    for mode in ("mesh", "fsdp"):
        np.testing.assert_allclose(runs[mode]["evaluate"]["loss"], one["loss"], rtol=1e-5)
        assert runs[mode]["evaluate"]["shards"] == four["shards"]


def test_checkpoints_move_between_four_devices_and_one(runs):
    """Written on 4 devices, resumed on 1; and written on 1, resumed on 4 with sharded params."""
    resumed_on_one = runs["a: 4 devices, resumed on 1"]
    assert resumed_on_one["devices"] == 1
    close(resumed_on_one, runs["single"])
    resumed_on_four = runs["b: 1 device, resumed on 4"]
    assert resumed_on_four["devices"] == 4
    close(resumed_on_four, runs["single"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(mode, work):
    """`mode` in two worker processes of two devices each, joined on a free port of 127.0.0.1."""
    port = free_port()
    procs = [
        start(
            mode,
            work,
            devices=2,
            extra_env={
                "DENSE_ARMOR_COORDINATOR": f"127.0.0.1:{port}",
                "DENSE_ARMOR_NUM_PROCESSES": "2",
                "DENSE_ARMOR_PROCESS_ID": str(i),
            },
        )
        for i in range(2)
    ]
    try:
        return [result(p, index=i, timeout=300) for i, p in enumerate(procs)]
    finally:
        for process, _ in procs:
            if process.poll() is None:
                process.kill()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Both two-process runs (data parallel, then a 2 x 2 mesh on halves of the data), in one
    pair of processes: `(the runs of each process, their directory)`."""
    work = tmp_path_factory.mktemp("multi")
    return run_processes("multi", work), work


@pytest.mark.multiprocess
def test_two_processes_on_loopback_agree_and_match_one(runs, two_processes):
    both, tmp_path = two_processes
    results = [r["multi"] for r in both]
    assert [r["processes"] for r in results] == [2, 2] and results[0]["devices"] == 4
    assert results[0] == results[1]
    close(results[0], runs["single"])
    # Evaluation split across both processes' devices: each holds 2 of the 4 devices' rows.
    assert results[0]["evaluate"]["shards"] == [[1, 1]] * 4
    np.testing.assert_allclose(
        results[0]["evaluate"]["loss"], runs["single"]["evaluate"]["loss"], rtol=1e-5
    )
    assert (tmp_path / "ckpt" / "best" / "weights.safetensors").exists()


@pytest.mark.parametrize("mode", ["tp", "tp+fsdp"])
def test_the_two_by_two_mesh_matches_one_device(runs, mode):
    """Heads and feed-forward units split over "model" (2), the batch over "data" (2): the
    single-device losses, and each device holds 1/2 of every head-split matrix (1/4 with FSDP
    on "data" as well), as the arrays the compiled step returned are laid out."""
    assert runs[mode]["devices"] == 4
    close(runs[mode], runs["single"])
    share = 0.5 if mode == "tp" else 0.25
    assert runs[mode]["head_split"] == {
        m: [share] for m in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")
    }
    np.testing.assert_allclose(
        runs[mode]["evaluate"]["loss"], runs["single"]["evaluate"]["loss"], rtol=1e-5
    )


def test_a_language_model_trains_on_the_two_by_two_mesh_as_on_one_device(runs):
    """`transformer_lm` on next tokens, its heads over "model" and its parameters over "data"
    too: the single-device losses, each device holding a quarter of the query projection."""
    single, sharded = runs["lm single"], runs["lm tp+fsdp"]
    np.testing.assert_allclose(sharded["train_loss"], single["train_loss"], rtol=1e-5)
    assert single["split"] == {"W_Q": [1.0], "table": [1.0]}
    assert sharded["split"]["W_Q"] == [0.25] and sharded["split"]["table"][0] < 1.0


def test_what_cannot_be_split_is_reported(runs):
    """FSDP over 4 devices: the output bias (2,) has no axis 4 divides, and a warning names it;
    2 heads over a "model" axis of 4: an error naming the layer and its head count."""
    (warning,) = runs["reported"]["warnings"]
    assert "1 arrays have no axis that the 4" in warning and ".layers[4].b.value (2,)" in warning
    error = runs["reported"]["heads over 4"]
    assert error is not None and "attention.W_Q (MultiHeadSelfAttention, 2 n_heads)" in error
    assert "cannot be split over 4" in error


@pytest.mark.parametrize("where", ["1", "4x1"])
def test_orbax_checkpoints_written_on_two_by_two_resume_elsewhere(runs, where):
    """4 steps on the 2 x 2 mesh, saved sharded with Orbax, resumed to 8 on one device and on
    4 x 1: the uninterrupted single run's losses and weights."""
    resumed = runs[f"orbax: 2x2, resumed on {where}"]
    assert resumed["devices"] == (1 if where == "1" else 4)
    close(resumed, runs["single"])


@pytest.mark.multiprocess
def test_two_processes_each_reading_its_half_match_one(runs, two_processes):
    """Two processes on 127.0.0.1, a 2 x 2 mesh across them (one "data" row each), each reading
    only its own half of the training data (a ShardSource) and writing its own shards of the
    Orbax checkpoints: the run of one process fed both halves."""
    both, tmp_path = two_processes
    results = [r["multi-halves"] for r in both]
    assert [r["processes"] for r in results] == [2, 2] and results[0]["devices"] == 4
    close(results[0], runs["halves"])
    assert results[0]["head_split"] == {
        m: [0.5] for m in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")
    }
    read = [set(r["read"]) for r in results]
    assert read[0] and read[1] and read[0] <= set(range(24)) and read[1] <= set(range(24, 48))
    # the latest step (8) kept, each process's shards written by itself
    model = tmp_path / "orbax" / "sharded" / "8" / "model"
    assert {p.name for p in model.glob("ocdbt.process_*")} == {"ocdbt.process_0", "ocdbt.process_1"}


def test_a_model_trained_sharded_exports_like_its_single_device_copy(runs):
    assert runs["fsdp"]["identical_exports"] is True


def test_initialize_passes_the_cluster_options_to_jax(monkeypatch):
    """`timeout`, `bind_address` and `local_device_ids` reach `jax.distributed.initialize`
    under JAX's names (the call itself is replaced: joining needs a cluster)."""
    import jax

    from dense_armor.distributed import initialize

    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    initialize("10.0.0.1:1234", 2, 1, timeout=60, bind_address="0.0.0.0:1234", local_device_ids=3)
    assert seen == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 2,
        "process_id": 1,
        "local_device_ids": 3,
        "initialization_timeout": 60,
        "coordinator_bind_address": "0.0.0.0:1234",
    }
