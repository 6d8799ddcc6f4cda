"""The device lane's code on the CPU, with XLA's CPU plugin for the C runner: what a developer
runs on an accelerator machine (tests/device_lane.py) exports, checks through JAX and from C,
and reports here too, so that CI keeps it alive without an accelerator."""

import json
import shutil

import jax
import pytest

import device_lane


def test_the_lane_exports_checks_and_reports_a_language_model_on_the_cpu(tmp_path):
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):  # .ci/run's machine has one
        pytest.skip("no C compiler here: the C runner cannot be built")
    name = "language model, greedy"
    device_lane.export(tmp_path / "cpu", [name], ["cpu"])
    rows = tmp_path / "rows.jsonl"
    artifacts = device_lane._artifacts([str(tmp_path / "cpu")])
    assert [a.name for a in artifacts] == [device_lane.slug(name)]
    device_lane.check_jax(artifacts, rows)
    device_lane.check_c(artifacts, rows, None, None)
    device_lane.report(rows, tmp_path / "report", "cpu", device_lane.machine())
    written = json.loads((tmp_path / "report" / "cpu.json").read_text())
    assert written["machine"]["platform"] == "cpu"
    found = [(r["family"], r["runtime"], r["exported_on"], r["ok"]) for r in written["rows"]]
    assert found == [(name, "jax", "cpu", True), (name, "c", "cpu", True)], written["rows"]
    for row in written["rows"]:  # golden cases, the decoding, and the steps past the capacity
        assert row["tokens_differ"] == 0 and row["max_error"] <= row["tolerance"]
        assert row["checks"] >= 8 and row["step_us"] > 0
        assert row["tolerance"] == 1e-4  # the CPU's, the platform read from each runtime
    table = (tmp_path / "report" / "cpu.md").read_text()
    assert "2 of 2 rows ok" in table and table.count("| language model, greedy |") == 2


def test_a_row_past_its_tolerance_or_with_a_token_off_is_not_ok(tmp_path):
    directory = tmp_path / "cpu" / "encoder"
    directory.mkdir(parents=True)
    (tmp_path / "cpu" / "exported.json").write_text(
        json.dumps({"exported_on": "cpu", "families": {"encoder": "encoder"}})
    )
    precision = {"tolerance": 1e-4, "accelerator_tolerance": 1e-3}
    (directory / "manifest.json").write_text(json.dumps({"precision": precision}))
    good = device_lane._row(
        directory, "c", {"forward": 1e-6, "decode (tokens that differ)": 0}, "cpu"
    )
    off = device_lane._row(
        directory, "c", {"forward": 1e-6, "decode (tokens that differ)": 1}, "tpu"
    )
    far = device_lane._row(directory, "c", {"forward": 2e-4}, "cpu")
    near = device_lane._row(directory, "jax", {"forward": 2e-4}, "tpu")  # the accelerator's
    assert (good["ok"], off["ok"], far["ok"], near["ok"]) == (True, False, False, True)
    assert off["tokens_differ"] == 1 and far["max_error"] == 2e-4
    assert (far["tolerance"], near["tolerance"]) == (1e-4, 1e-3)


def test_the_readmes_tpu_section_is_the_committed_reports():
    root = device_lane.ROOT
    text = (root / "README.md").read_text()
    section = text[
        text.index(device_lane.BEGIN) + len(device_lane.BEGIN) : text.index(device_lane.END)
    ]
    report = root / "docs" / "devices" / "tpu-v5e.json"
    assert section.strip() == device_lane.readme_section(report).strip()
    rows = json.loads(report.read_text())["rows"]
    assert {r["runtime"] for r in rows} == {"jax", "c"} and {r["exported_on"] for r in rows} == {
        "cpu",
        "tpu",
    }


def test_the_serving_rows_run_here_and_make_their_table(tmp_path):
    """The serving phase's code on the CPU at a tiny shape: a row per configuration (fixed and
    paged, several decoding steps per dispatch, `warm_up` timed) and `generate`'s, each with
    positive rates; the report's serving table lists them."""
    rows = tmp_path / "rows.jsonl"
    configs = "2:fixed:3:warm,2:paged:2,2:paged-gather:1"
    profiles = tmp_path / "profiles"
    device_lane.main(
        ["serve", "--rows", str(rows), "--tiny", "--configs", configs, "--profile", str(profiles)]
    )
    found = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(r["kind"], r["slots"], r["cache"], r["decode_steps"]) for r in found] == [
        ("generate", 1, "fixed", None), ("serve", 2, "fixed", 3), ("serve", 2, "paged", 2),
        ("serve", 2, "paged-gather", 1),
    ]  # fmt: skip
    assert all(r["decode_tokens_per_s"] > 0 for r in found)
    assert all(r["tokens_per_s"] > 0 for r in found[1:])
    assert [r["warm_up_s"] is not None for r in found] == [False, True, False, False]
    # each configuration's traced run, summed by line: the host's executions of the tick
    summary = json.loads((profiles / "2-paged-2.json").read_text())
    lines = [line for plane in summary["planes"].values() for line in plane.values()]
    names = {t["name"] for line in lines for t in line["top"]}
    assert summary["wall_ms"] > 0 and any("paged_tick" in name for name in names), names
    assert any(line["busy_ms"] > 0 for line in lines)
    info = {"platform": "cpu", "device": "cpu", "date": "2026-12-07", "host": "x86_64",
            "cores": 2, "versions": {"jax": jax.__version__}}  # fmt: skip
    device_lane.report(rows, tmp_path / "report", "cpu", info)
    written = json.loads((tmp_path / "report" / "cpu.json").read_text())
    assert (written["rows"], len(written["serving"])) == ([], 4)
    table = (tmp_path / "report" / "cpu.md").read_text()
    assert table.count("| tiny bfloat16 | Server | 2 |") == 3
    assert "| tiny bfloat16 | generate | 1 | fixed |" in table
