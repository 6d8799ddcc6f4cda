"""Every example runs, on settings small enough for the suite."""

import importlib.util
import json
import math
import pathlib

import pytest

from dense_armor.checkpoints import load_checkpoint
from environment import CACHE_SETTINGS, child_env

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_example_matches_forward(capsys):
    report = load("stream").main(["--steps", "24", "--capacity", "32", "--check-every", "5"])
    assert report["max_error"] < 1e-4
    assert "per step" in capsys.readouterr().out


def test_stream_example_rejects_more_steps_than_capacity():
    with pytest.raises(SystemExit):
        load("stream").main(["--steps", "40", "--capacity", "32"])


@pytest.mark.optax
def test_digits_quick_run_and_export_pipeline(tmp_path, capsys, monkeypatch):
    """A few steps of the main job: train, checkpoint, plots, early decisions, export, verify."""
    for name, value in CACHE_SETTINGS.items():  # its run.py subprocess: the suite's cache too
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location(
        "pipeline", EXAMPLES.parent / "export" / "pipeline.py"
    )
    pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)
    runs, out = tmp_path / "runs", tmp_path / "artifacts"
    args = ["--steps", "30", "--eval-every", "10", "--runs", str(runs), "--out", str(out)]
    args.append("--no-progress")
    result = pipeline.main([*args, "--platforms", "cpu"])  # every platform: tests/test_export.py
    printed = capsys.readouterr().out
    assert "test accuracy" in printed and "(ok)" in printed
    report = json.loads((runs / "report.json").read_text())
    assert len(report["accuracy_by_rows"]) == 8
    assert report["max_gap_step_vs_forward"] < 1e-4
    assert report["split_sizes"] == {"train": 1257, "valid": 180, "test": 360}
    for plot in report["plots"]:
        assert pathlib.Path(plot).read_bytes().startswith(b"\x89PNG")
    assert (runs / "comparison.png").exists()
    rows = {row["model"]: row for row in report["comparison"]}
    assert list(rows) == ["attention", "GRU", "minGRU", "minGRU + attention"]
    assert rows["attention"]["test_accuracy"] == report["test_accuracy"]
    # A recurrent state has one size; the attention caches gain a key and a value per block and
    # step: 2 arrays x 2 blocks x 64 float32 numbers (a mixed stack has one attention block).
    assert rows["GRU"]["state_bytes_per_step"] == rows["minGRU"]["state_bytes_per_step"] == 0
    assert rows["attention"]["state_bytes_per_step"] == 2 * 2 * 64 * 4
    assert rows["minGRU + attention"]["state_bytes_per_step"] == 2 * 64 * 4
    for row in rows.values():
        assert 0.0 <= row["test_accuracy"] <= 1.0 and row["train_seconds"] > 0
        assert len(row["accuracy_by_rows"]) == 8 and row["step_seconds"] > 0
    assert "minGRU + attention" in printed
    assert (runs / "best" / "weights.safetensors").exists()
    assert max(result["errors"]["jax"].values()) < 1e-4
    assert max(result["errors"]["iree"].values()) < 1e-4
    assert {name.split()[1] for name in result["errors"]["iree"]} == {
        "forward",
        "init_cache",
        "step",
        "prefill",
        "reset",
    }
    # and from C, through the artifact's runner on the PJRT CPU plugin (the suite installs both)
    assert {name.split()[1] for name in result["errors"]["pjrt"]} == {
        "forward", "init_cache", "step", "prefill", "reset",
    }  # fmt: skip
    assert max(result["errors"]["pjrt"].values()) < 1e-4
    assert (out / "manifest.json").exists() and (tmp_path / "artifacts-report.json").exists()
    assert not (out / "report.json").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["functions"]["forward"]["platforms"] == ["cpu"]
    # a second run reuses the finished checkpoint instead of training again
    saved = (runs / "last" / "weights.safetensors").stat().st_mtime_ns
    again = load("digits").main(  # (the comparison's own runs are not what this checks)
        ["--steps", "30", "--eval-every", "10", "--out", str(runs), "--no-progress", "--no-compare"]
    )
    assert again["test_accuracy"] == result["test_accuracy"]
    assert (runs / "last" / "weights.safetensors").stat().st_mtime_ns == saved


@pytest.mark.parametrize(
    "options, mesh, saved",
    [
        ([], "2 devices (2 data x 1 model", "best/weights.safetensors"),
        (["--model-axis", "2", "--orbax"], "4 devices (2 data x 2 model", "sharded/6/model"),
    ],
    ids=["data parallel, 2 devices", "2 x 2 mesh, sharded checkpoints"],
)
def test_data_parallel_example_runs_over_a_mesh(tmp_path, options, mesh, saved):
    import subprocess
    import sys

    devices = "4" if "--model-axis" in options else "2"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "data_parallel.py"), "--cpu-devices", devices,
         "--steps", "6", "--batch-size", "16", "--out", str(tmp_path / "run"), *options],
        capture_output=True,
        text=True,
        env=child_env(as_users_run=True),
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"mesh: {mesh}" in result.stdout and "test accuracy" in result.stdout
    assert (tmp_path / "run" / saved).exists()


@pytest.mark.optax
def test_language_model_example_learns_bytes_and_saves_a_checkpoint(tmp_path, capsys):
    report = load("language_model").main(
        ["--steps", "60", "--length", "16", "--batch-size", "16", "--sample-bytes", "8",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert report["valid_loss"] < 0.8 * math.log(256)  # well below a uniform guess over bytes
    assert {p.name for p in tmp_path.iterdir()} >= {
        "checkpoint",
        "artifact",
        "report.json",
        "loss.png",
    }
    out = capsys.readouterr().out
    assert "--- greedy ---\ndef " in out and "held-out next-byte loss" in out
    # the exported artifact, decoding in its own graph, writes the Python model's greedy bytes
    samples = report["samples"]
    assert samples["greedy from the artifact"] == samples["greedy"]
    assert "--- greedy, from the exported artifact ---\ndef " in out
    assert load_checkpoint(tmp_path / "checkpoint").config.factory == "transformer_lm"
