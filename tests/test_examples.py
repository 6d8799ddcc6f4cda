"""Every example runs, on settings small enough for the suite."""

import importlib.util
import pathlib

import pytest

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
