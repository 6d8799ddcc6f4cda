"""Deployment from C: every artifact's `runner.c`, built with the system C compiler, runs the
static modules through XLA's PJRT CPU plugin (`xla-cpu-pjrt`) and reproduces the Python model's
golden outputs, the cache staying on the device through a stream of steps; a tampered, truncated
or edited artifact and a missing or foreign plugin are refused with one clear line."""

import json
import os
import pathlib
import re
import shutil
import subprocess

import jax
import pytest

from dense_armor.checkpoints import ModelConfig
from dense_armor.cli import main as cli
from dense_armor.export import export_model
from dense_armor.export.standalone import (
    ArtifactError,
    build_runner,
    default_plugin,
    run_pjrt,
    sha256,
)
from dense_armor.huggingface import import_hf
from environment import run_py_without
from test_language_models import DATA

if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):  # .ci/run's machine has one
    pytest.skip("no C compiler here: the C runner cannot be built", allow_module_level=True)

ENCODER = {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 2, "n_out": 4,
           "max_len": 8, "causal": True}  # fmt: skip
DECODER = {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "n_out": 4,
           "max_len": 8, "d_context": 5, "window": 3, "norm_first": True}  # fmt: skip
MODELS = {
    "encoder": ("transformer_encoder", ENCODER, [(2, 5)]),
    "windowed encoder": ("transformer_encoder", {**ENCODER, "window": 3}, [(2, 5)]),
    "decoder with a context": ("transformer_decoder", DECODER, [(2, 5, 3)]),
    "mixed recurrent stack": (
        "transformer_encoder",
        {**ENCODER, "depth": 3, "mixers": ["mingru", "attention", "lstm"]},
        [(2, 5)],
    ),
    "bfloat16": ("transformer_encoder", {**ENCODER, "compute_dtype": "bfloat16"}, [(1, 4)]),
}
FUNCTIONS = {"forward", "init_cache", "step", "prefill", "reset"}
LINE = re.compile(r"^  (pjrt \S.*?)\s+max \|error\| = (\S+)$", re.M)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The C runner, built once (every artifact carries the same runner.c and header)."""
    work = tmp_path_factory.mktemp("runner")
    art = _export("encoder", work / "encoder")
    warnings = build_runner(art, work / "runner")
    assert warnings == "", warnings  # -Wall -Wextra: clean
    return work / "runner", art


def _export(name, out, capacity=6):
    family, arguments, shapes = MODELS[name]
    config = ModelConfig(family, arguments)
    model = config.build(jax.random.PRNGKey(3))
    export_model(model, config, out, capacity=capacity, platforms=["cpu"], static_shapes=shapes)
    return out


def _run(runner, art, *extra):
    done = subprocess.run(
        [str(runner), str(art), "--plugin", str(default_plugin()), *extra],
        capture_output=True,
        text=True,
    )
    return done, {name: float(value) for name, value in LINE.findall(done.stdout)}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_c_runner_reproduces_the_golden_outputs(runner, tmp_path, name):
    binary, encoder = runner
    art = encoder if name == "encoder" else _export(name, tmp_path / "art")
    done, errors = _run(binary, art)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {e.split()[1].rstrip(",") for e in errors} == FUNCTIONS
    # the stream: 6 steps, past a window of 3 (its ring wraps), the cache never leaving the device
    assert [e for e in errors if re.fullmatch(r"pjrt step B=\d( S=3)?, 6 steps", e)]
    assert re.search(r"[\d.]+ us per step \(median of 6, cache on the device\)", done.stdout)
    limit = 5e-2 if name == "bfloat16" else 1e-5
    assert max(errors.values()) < limit, done.stdout
    assert "(ok)" in done.stdout and "cpu, PJRT C API" in done.stdout


def test_a_language_model_decodes_token_exact_from_c(runner, tmp_path):
    """GPT-2-like: `sample_step` fed its own tokens for 32 steps, the cache on the device."""
    binary, _ = runner
    model, arguments = import_hf(DATA / "gpt2")
    config = ModelConfig("transformer_lm", arguments)
    out = tmp_path / "lm"
    export_model(model, config, out, capacity=32, platforms=["cpu"], static_shapes=[(2, 4)])
    done, errors = _run(binary, out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert errors["pjrt sample_step B=2, 32 tokens (tokens that differ)"] == 0.0
    assert errors["pjrt sample_step B=2, 32 steps"] < 1e-4  # the cache after them
    assert errors["pjrt sample_prefill B=2 T=4"] < 1e-4  # the token exact: ids differ by >= 1
    assert max(errors.values()) < 1e-4, done.stdout


MODULES = re.compile(r"^  modules: (\d+) compiled, (\d+) read from the cache (.*)$", re.M)


def test_the_executable_cache_is_read_back_and_a_damaged_entry_compiled_again(runner, tmp_path):
    """`--cache DIR`: the first run compiles the five modules and keeps them, the second reads
    them back with the same errors bit for bit; an entry truncated or with a byte changed is
    compiled again (never loaded) and replaced; other XLA_FLAGS are another key; a cache that
    cannot be written costs only the cache, with a warning."""
    binary, art = runner
    cache = tmp_path / "cache"

    def run(*extra, env=None):
        done = subprocess.run(
            [str(binary), str(art), "--plugin", str(default_plugin()), "--cache", str(cache)],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        found = MODULES.search(done.stdout)
        assert found and found.group(3) == str(cache), done.stdout
        return LINE.findall(done.stdout), (int(found.group(1)), int(found.group(2))), done.stderr

    first, counts, _ = run()
    assert counts == (5, 0) and len(list(cache.glob("*.pjrt"))) == 5
    again, counts, _ = run()
    assert counts == (0, 5) and again == first
    entries = sorted(cache.glob("*.pjrt"))
    entries[0].write_bytes(entries[0].read_bytes()[:-100])  # truncated
    damaged = bytearray(entries[1].read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # one bit of the executable
    entries[1].write_bytes(bytes(damaged))
    repaired, counts, _ = run()
    assert counts == (2, 3) and repaired == first
    assert run()[1] == (0, 5)  # replaced by whole entries
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_fast_min_max=false",
    }
    assert run(env=env)[1] == (5, 0) and len(list(cache.glob("*.pjrt"))) == 10
    shutil.rmtree(cache)
    cache.write_text("a file, not a directory")
    unwritable, counts, warning = run()
    assert counts == (5, 0) and unwritable == first
    assert f"warning: cannot write the executable cache {cache}" in warning


def test_the_runner_fails_on_wrong_weights_whose_sha256_was_updated(runner, tmp_path):
    """A check that can fail: weights changed and the manifest's sha256 rewritten to match."""
    binary, art = runner
    shutil.copytree(art, tmp_path / "art")
    path = tmp_path / "art" / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x00\x00\x80\x3f"  # the last float32 weight (an output bias) becomes 1.0
    path.write_bytes(bytes(data))
    _rewrite_entry(tmp_path / "art", "weights.safetensors")
    done, errors = _run(binary, tmp_path / "art")
    assert done.returncode == 1 and "(FAILED)" in done.stdout, done.stdout + done.stderr
    assert errors["pjrt forward B=2 T=5"] > 1e-3
    assert errors["pjrt init_cache B=2"] == 0.0  # the cache starts empty whatever the weights


def _rewrite_entry(art, name):
    manifest = json.loads((art / "manifest.json").read_text())
    path = art / name
    manifest["files"][name] = {"sha256": sha256(path), "bytes": path.stat().st_size}
    (art / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(art, edit):
    manifest = json.loads((art / "manifest.json").read_text())
    edit(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))


def _tamper(art):
    path = art / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _truncate(art, name="weights.safetensors"):
    path = art / name
    path.write_bytes(path.read_bytes()[:-7])
    _rewrite_entry(art, name)  # past the sha256 check: the reader itself must notice


def _huge_header(art):
    path = art / "golden.safetensors"
    path.write_bytes((2**40).to_bytes(8, "little") + path.read_bytes()[8:])
    _rewrite_entry(art, "golden.safetensors")


def _bad_header_json(art):
    path = art / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("[")  # the header's opening brace
    path.write_bytes(bytes(data))
    _rewrite_entry(art, "weights.safetensors")


def _header_a_list(art):
    path = art / "weights.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"[]".ljust(length) + data[8 + length :])
    _rewrite_entry(art, "weights.safetensors")


def _output_shape(manifest):
    manifest["functions"]["step"]["outputs"][0]["shape"] = ["B", 5]


def _kept(manifest):
    manifest["static"][2]["kept_inputs"] = manifest["static"][2]["kept_inputs"][1:]


# (what is wrong, how to make it so, the message, the exit status)
REFUSALS = [
    ("tampered weights", _tamper, r"weights.safetensors does not match its sha256", 2),
    ("truncated safetensors", _truncate, r"unreadable safetensors file .*weights.safetensors", 2),
    ("a header past the file", _huge_header, r"its header claims 1099511627776 bytes", 2),
    ("a header not JSON", _bad_header_json, r"safetensors: its header is not valid JSON", 2),
    ("a header that is not an object", _header_a_list, r"its header is not an object", 2),
    ("a missing file", lambda a: (a / "golden.safetensors").unlink(), "missing artifact file", 2),
    ("no manifest", lambda a: (a / "manifest.json").unlink(), "has no manifest.json", 2),
    (
        "a manifest that is not JSON",
        lambda a: (a / "manifest.json").write_text('{"format": '),
        r"manifest.json is not valid JSON",
        2,
    ),
    (
        "a manifest without its weights",
        lambda a: _edit_manifest(a, lambda m: m.pop("weights")),
        r"lacks the key `weights`",
        2,
    ),
    (
        "an edited output shape",
        lambda a: _edit_manifest(a, _output_shape),
        r"the manifest says output y_t is \(2, 5\) float32; the module has \(2, 4\) float32",
        2,
    ),
    (
        "edited kept inputs",
        lambda a: _edit_manifest(a, _kept),
        r"the manifest lists \d+ inputs of this module; the module has \d+ \(manifest edited\?\)",
        2,
    ),
    (
        "another major API version recorded",
        lambda a: _edit_manifest(a, lambda m: m["pjrt"].update(api_version=[1, 0])),
        r"implements PJRT C API 0\.\d+; the artifact was checked with 1\.0: the major versions",
        2,
    ),
    (
        "another format version",
        lambda a: _edit_manifest(a, lambda m: m.update(format_version=1)),
        r"has format version 1; this runner reads version 2",
        2,
    ),
]


@pytest.mark.parametrize(
    ("what", "make", "message", "status"), REFUSALS, ids=[r[0] for r in REFUSALS]
)
def test_the_runner_refuses_a_bad_artifact(runner, tmp_path, what, make, message, status):
    binary, art = runner
    shutil.copytree(art, tmp_path / "art")
    make(tmp_path / "art")
    done, _ = _run(binary, tmp_path / "art")
    assert done.returncode == status, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert re.search(message, lines[0]), lines[0]


def test_the_runner_refuses_a_missing_or_foreign_plugin_and_bad_arguments(runner, tmp_path):
    binary, art = runner
    libm = next(
        p
        for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6", "/lib64/libm.so.6")
        if pathlib.Path(p).is_file()
    )
    (tmp_path / "text.so").write_text("not a shared object")
    cases = [
        (["--plugin", str(tmp_path / "absent.so")], r"cannot load the PJRT plugin .*absent\.so"),
        (["--plugin", str(tmp_path / "text.so")], r"cannot load the PJRT plugin .*text\.so"),
        (["--plugin", libm], r"libm\.so\.6 has no GetPjrtApi: not a PJRT plugin"),
        (["--plugin", str(default_plugin()), "--steps", "0"], r"--steps must be a positive"),
        (["--plugin", str(default_plugin()), "--repeat", "x"], r"--repeat must be a positive"),
        (["--plugin", str(default_plugin()), "--tolerance", "nan"], r"--tolerance must be"),
    ]
    for arguments, message in cases:
        done = subprocess.run([str(binary), str(art), *arguments], capture_output=True, text=True)
        assert done.returncode == 2, (arguments, done.stdout, done.stderr)
        assert re.search(message, done.stderr) and done.stderr.count("\n") == 1, done.stderr
    for arguments in ([], ["--plugin", str(default_plugin()), "--cache"]):  # no plugin; no DIR
        done = subprocess.run([str(binary), str(art), *arguments], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.startswith(
            "usage: runner ARTIFACT_DIR --plugin"
        )
        assert "[--cache DIR]" in done.stderr


def test_an_older_plugin_minor_version_is_a_warning(runner, tmp_path):
    binary, art = runner
    shutil.copytree(art, tmp_path / "art")
    _edit_manifest(tmp_path / "art", lambda m: m["pjrt"].update(api_version=[0, 9999]))
    done, errors = _run(binary, tmp_path / "art", "--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.match(r"warning: the plugin .* implements PJRT C API 0\.\d+, older than the 0\.9999",
                    done.stderr)  # fmt: skip
    assert "pjrt step B=2, 2 steps" in errors  # --steps: the stream's first two


def test_the_artifact_records_the_header_and_plugin_it_was_exported_beside(runner):
    _, art = runner
    manifest = json.loads((art / "manifest.json").read_text())
    header = (art / "pjrt_c_api.h").read_text()
    major = int(re.search(r"#define PJRT_API_MAJOR (\d+)", header).group(1))
    minor = int(re.search(r"#define PJRT_API_MINOR (\d+)", header).group(1))
    assert manifest["pjrt"]["api_version"] == [major, minor]
    assert manifest["pjrt"]["plugins"]["xla-cpu-pjrt"]
    for name in ("runner.c", "pjrt_c_api.h"):  # listed and sha256-checked like every file
        assert manifest["files"][name]["sha256"] == sha256(art / name)


def test_run_py_pjrt_from_the_artifact_alone(runner, tmp_path):
    """`python run.py DIR --pjrt` builds runner.c and runs it, with neither jax nor dense_armor
    importable; its report holds the runner's errors."""
    _, art = runner
    report = tmp_path / "report.json"
    blocked = ("dense_armor", "jax", "jaxlib")
    done = run_py_without(art, blocked, "--pjrt", "--report", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pjrt step B=2, 6 steps" in done.stdout and "(ok)" in done.stdout
    written = json.loads(report.read_text())
    assert set(written["errors"]) == set(dict(LINE.findall(done.stdout)))
    assert written["max"] < 1e-5


def test_cli_runner_and_its_refusals(runner, tmp_path, capsys):
    _, art = runner
    assert cli(["runner", str(art), "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert "pjrt step B=2, 3 steps" in printed and "(ok)" in printed
    assert cli(["runner", str(art), "--plugin", str(tmp_path / "none.so")]) == 2
    assert "cannot load the PJRT plugin" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match=r"has no runner\.c"):
        run_pjrt(tmp_path / "empty")
    with pytest.raises(ArtifactError, match="cannot run the C compiler"):
        run_pjrt(art, cc=str(tmp_path / "no-such-cc"))
    with pytest.raises(ArtifactError, match="`repeat` must be a positive integer"):
        run_pjrt(art, repeat=True)
    with pytest.raises(ArtifactError, match="`steps` must be a positive integer"):
        run_pjrt(art, steps=0)


def test_the_export_pages_c_listing_is_an_excerpt_of_the_runner():
    """The docs' C listing is the runner's own lines: each run of lines between two `...` (what
    is left out) is a run of consecutive lines of runner.c."""
    root = pathlib.Path(__file__).resolve().parent.parent
    page = (root / "docs" / "export.md").read_text()
    listing = re.search(r"^```c\n(.*?)^```", page, re.S | re.M).group(1)
    source = "\n".join(
        line.strip() for line in (root / "src/dense_armor/export/runner.c").read_text().splitlines()
    )
    blocks = "\n".join(line.strip() for line in listing.splitlines()).split("...")
    assert len(blocks) >= 6
    for block in blocks:
        assert "\n" + block.strip("\n") + "\n" in "\n" + source + "\n", block
