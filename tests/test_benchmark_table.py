"""The Performance page's benchmark table is what tests/benchmarks/recorded.json generates, and the
regression guard prints a run's figures beside the recorded ones."""

import json

import pytest

from benchmarks import recorded

FIGURES = {
    "encoder training step/dense_armor": 0.200,
    "encoder training step/equinox": 0.250,
    "encoder training step/flax nnx": 0.300,
    "encoder forward/dense_armor": 0.040,
    "encoder forward/equinox": 0.050,
    "encoder forward/flax nnx": 0.060,
    "streaming step/dense_armor step": 100e-6,
    "streaming step/dense_armor stream": 50e-6,
    "streaming step/flax nnx decode": 300e-6,
    "streaming step/recompute": 4e-3,
    "exported/python forward (jit)": 0.040,
    "exported/exported forward": 0.044,
    "exported/python step (jit)": 2e-3,
    "exported/exported step": 1e-3,
}


def test_the_readme_table_is_the_recorded_run():
    text = recorded.PAGE.read_text()
    assert recorded.readme_block(text) == recorded.table(recorded.load())


def test_the_table_shows_each_peer_over_dense_armor():
    table = recorded.table({"date": "2026-12-01", "machine": "a CPU", "figures": FIGURES})
    assert (
        "| encoder training step, B=32 T=128 d_model=128 depth 2 (adam, jit) | 200.0 ms |" in table
    )
    assert "250.0 ms (1.25x)" in table and "300.0 ms (1.50x)" in table
    assert (
        "| 50 us | | 300 us (6.00x, decode cache) | recompute over the prefix: 4.00 ms (80x) |"
        in table
    )
    assert "callback in the step) | 100 us | | 300 us (3.00x) | |" in table
    assert "1.10x / 0.50x" in table and "2026-12-01, a CPU" in table


def test_the_guard_prints_each_figure_beside_the_recorded_one():
    now = {**FIGURES, "encoder forward/dense_armor": 0.060, "new/figure": 1.0}
    old = {"date": "2026-11-30", "machine": "a CPU", "figures": FIGURES}
    lines = recorded.compare(now, old).splitlines()
    assert "2026-11-30, a CPU" in lines[1]
    row = next(line for line in lines if line.startswith("encoder forward/dense_armor"))
    assert row.split()[-5:] == ["40.0", "ms", "60.0", "ms", "1.50x"]
    new = next(line for line in lines if line.startswith("new/figure"))
    assert new.split()[-4:] == ["-", "1000.0", "ms", "-"]


def test_record_writes_the_figures_and_the_table(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{recorded.BEGIN}\nold\n{recorded.END}\n\nafter\n")
    monkeypatch.setattr(recorded, "PAGE", readme)
    monkeypatch.setattr(recorded, "RECORDED", tmp_path / "recorded.json")
    recorded.write(FIGURES, "2026-12-01", "a CPU")
    written = json.loads((tmp_path / "recorded.json").read_text())
    assert written["figures"] == FIGURES and written["date"] == "2026-12-01"
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{recorded.END}\n\nafter\n")
    assert recorded.readme_block(text) == recorded.table(written)
    with pytest.raises(SystemExit, match="lacks"):
        recorded.write({"encoder forward/dense_armor": 1.0}, "2026-12-01", "a CPU")


def test_a_corrupted_record_names_its_file(tmp_path):
    (tmp_path / "recorded.json").write_text('{"figures": ')
    with pytest.raises(ValueError, match=r"recorded.json: not JSON .*--record"):
        recorded.load(tmp_path / "recorded.json")
    (tmp_path / "recorded.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"recorded.json: expected an object"):
        recorded.load(tmp_path / "recorded.json")


def test_the_one_batch_training_step_gets_its_own_row_when_recorded():
    """dense_armor's model in the peers' one-batch step: a row under the training step, the
    peers over it, present only when the run recorded it."""
    figures = {**FIGURES, "encoder training step/dense_armor, one batch": 0.225}
    table = recorded.table({"date": "2026-12-02", "machine": "a CPU", "figures": figures})
    row = next(line for line in table.splitlines() if line.startswith(f"| {recorded.ONE_BATCH}"))
    assert row == f"| {recorded.ONE_BATCH} | 225.0 ms | 250.0 ms (1.11x) | 300.0 ms (1.33x) | |"
    plain = recorded.table({"date": "2026-12-02", "machine": "a CPU", "figures": FIGURES})
    assert recorded.ONE_BATCH not in plain
