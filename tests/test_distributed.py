"""Data parallelism on JAX's own engine, on this CPU: 4 forced host devices in one process, and
two processes of two devices each on 127.0.0.1, against the single-device run."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKER = pathlib.Path(__file__).resolve().parent / "distributed" / "worker.py"


def run(mode, tmp_path, devices=1, checkpoint=None, steps=8, extra_env=None, name=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.update(extra_env or {})
    out = tmp_path / f"{name or mode}-{devices}.json"
    args = [sys.executable, str(WORKER), mode, str(out), str(checkpoint or "-"), str(steps)]
    return subprocess.Popen(
        args,
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ), out


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
def single(tmp_path_factory):
    return result(run("single", tmp_path_factory.mktemp("single")))


@pytest.mark.parametrize("mode", ["mesh", "fsdp"])
def test_four_devices_match_one(single, tmp_path, mode):
    four = result(run(mode, tmp_path, devices=4))
    assert four["devices"] == 4
    close(four, single)


def test_checkpoints_move_between_four_devices_and_one(single, tmp_path):
    """Written on 4 devices, resumed on 1; and written on 1, resumed on 4 with sharded params."""
    result(run("mesh", tmp_path, devices=4, checkpoint=tmp_path / "a", steps=4, name="a4"))
    resumed_on_one = result(run("single", tmp_path, checkpoint=tmp_path / "a", steps=8, name="a1"))
    close(resumed_on_one, single)
    result(run("single", tmp_path, checkpoint=tmp_path / "b", steps=4, name="b1"))
    resumed_on_four = result(
        run("fsdp", tmp_path, devices=4, checkpoint=tmp_path / "b", steps=8, name="b4")
    )
    close(resumed_on_four, single)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_on_loopback_agree_and_match_one(single, tmp_path):
    port = free_port()
    procs = [
        run(
            "multi",
            tmp_path,
            devices=2,
            checkpoint=tmp_path / "ckpt",
            extra_env={
                "DENSE_ARMOR_COORDINATOR": f"127.0.0.1:{port}",
                "DENSE_ARMOR_NUM_PROCESSES": "2",
                "DENSE_ARMOR_PROCESS_ID": str(i),
            },
            name="multi",
        )
        for i in range(2)
    ]
    try:
        results = [result(p, index=i, timeout=240) for i, p in enumerate(procs)]
    finally:
        for process, _ in procs:
            if process.poll() is None:
                process.kill()
    assert [r["processes"] for r in results] == [2, 2] and results[0]["devices"] == 4
    assert results[0] == results[1]
    close(results[0], single)
    assert (tmp_path / "ckpt" / "best" / "weights.safetensors").exists()


def test_a_model_trained_sharded_exports_like_its_single_device_copy(single, tmp_path):
    out = result(run("export", tmp_path, devices=4))
    close(out, single)
    assert out["identical_exports"] is True
