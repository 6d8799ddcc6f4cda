"""Deployment without JAX: the static modules compile with IREE for llvm-cpu (and cuda, compiled
only), and IREE's own runner reproduces the Python model's golden outputs, a stream of steps
with the cache fed back included."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys

import jax
import pytest

from dense_armor.checkpoints import ModelConfig
from dense_armor.cli import main as cli
from dense_armor.export import ArtifactError, export_model, load
from dense_armor.export.iree import compile_artifact, host_cpu, target_flags
from dense_armor.export.standalone import check_iree, sha256
from environment import run_py_without

ENCODER = ModelConfig(
    "transformer_encoder",
    {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 2, "n_out": 4, "max_len": 8,
     "causal": True},
)  # fmt: skip
DECODER = ModelConfig(
    "transformer_decoder",
    {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "n_out": 4, "max_len": 8,
     "d_context": 5, "window": 3, "norm_first": True},
)  # fmt: skip
FUNCTIONS = {"forward", "init_cache", "step", "prefill", "reset"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The encoder, exported for cpu and cuda, compiled for llvm-cpu and (compile only) cuda
    and vulkan-spirv."""
    out = tmp_path_factory.mktemp("iree") / "encoder"
    model = ENCODER.build(jax.random.PRNGKey(0))
    export_model(model, ENCODER, out, capacity=6, platforms=["cpu", "cuda"], static_shapes=[(2, 5)])
    summary = compile_artifact(out, ["llvm-cpu", "cuda", "vulkan-spirv"], jobs=2)
    return out, summary


def test_every_static_module_compiles_and_is_listed_with_its_sha256(compiled):
    out, summary = compiled
    manifest = load(out).manifest
    modules = {e["bytecode"] for e in manifest["static"]}
    assert len(modules) == 5  # the cuda lowering is the cpu one, written once
    pairs = {(c["module"], c["target"]) for c in manifest["compiled"]}
    assert pairs == {(m, t) for m in modules for t in ("llvm-cpu", "cuda", "vulkan-spirv")}
    for c in manifest["compiled"]:
        assert manifest["files"][c["file"]]["sha256"] == sha256(out / c["file"])
        assert c["flags"] == target_flags(c["target"])
    assert set(summary.files) == {c["file"] for c in manifest["compiled"]}
    # static modules carry no donation: IREE computes wrong results when inputs alias outputs
    for module in modules:
        text = (out / module.replace(".mlirbc", ".mlir")).read_text()
        assert "aliasing_output" not in text and "buffer_donor" not in text
        # a row write is a scatter into the leading axis of the flattened buffer; never the
        # batched dynamic-update-slice into an inner axis, which IREE rejects
        assert "dynamic_update_slice" not in text
        if "step" in module or "prefill" in module:
            assert "stablehlo.scatter" in text


def test_the_compile_cache_gives_the_compilers_own_bytes(compiled, tmp_path, monkeypatch):
    out, _ = compiled
    shutil.copytree(out, tmp_path / "art")
    cache = tmp_path / "cache"
    first = compile_artifact(tmp_path / "art", ["llvm-cpu"], jobs=2, cache=cache)  # stores
    stored = {f.read_bytes() for f in cache.glob("*.vmfb")}
    assert len(stored) == 5 and not list(cache.glob(".*"))  # whole entries, nothing partial
    written = {(tmp_path / "art" / name).read_bytes() for name in first.files}
    assert written == stored  # (iree-compile's bytes differ from one run to the next)

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr("iree.compiler.tools.compile_file", no_compiler)
    again = compile_artifact(tmp_path / "art", ["llvm-cpu"], jobs=2, cache=cache)  # every hit
    assert {(tmp_path / "art" / name).read_bytes() for name in again.files} == stored
    assert max(check_iree(tmp_path / "art").values()) < 1e-5
    with pytest.raises(AssertionError, match="compiled again"):  # another CPU: another key
        compile_artifact(tmp_path / "art", ["llvm-cpu"], cpu="generic", cache=cache)
    # a truncated entry is no entry: compiled again (here, the compiler refusing), never copied
    entry = next(cache.glob("*.vmfb"))
    entry.write_bytes(entry.read_bytes()[:-10])
    with pytest.raises(AssertionError, match="compiled again"):
        compile_artifact(tmp_path / "art", ["llvm-cpu"], jobs=2, cache=cache)
    assert not entry.exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ArtifactError, match=r"the compile cache .*afile is a file"):
        compile_artifact(tmp_path / "art", ["llvm-cpu"], cache=tmp_path / "afile")


def test_iree_runner_reproduces_the_golden_outputs(compiled):
    """In IREE's runtime in this process and in its tool (a process per call), the same module
    gives the same outputs bit for bit: the same errors."""
    out, _ = compiled
    errors = check_iree(out, runner="python")
    assert {name.split()[1] for name in errors} == FUNCTIONS
    assert "iree step B=2, 6 steps" in errors  # the stream, the cache fed back by IREE
    assert max(errors.values()) < 1e-5, errors
    assert check_iree(out, runner="iree-run-module", device="local-sync") == errors


def test_the_python_runner_is_refused_where_iree_s_bindings_are_not_installed(
    compiled, monkeypatch
):
    out, _ = compiled
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "iree.runtime" else real(name, *a),
    )
    with pytest.raises(ArtifactError, match=r"IREE's Python runtime is not installed: pip install"):
        check_iree(out, runner="python")
    assert check_iree(out, runner="auto") == check_iree(out, runner="iree-run-module")


@pytest.mark.parametrize(
    "blocked, flags, runner",
    [
        ((), [], "IREE's Python runtime (local-task)"),  # auto: the bindings, installed here
        ((), ["--iree-runner", "iree-run-module"], "iree-run-module (local-task)"),
        (("iree",), [], "iree-run-module (local-task)"),  # auto: only IREE's tools to be found
    ],
)
def test_run_py_checks_with_iree_without_jax_or_dense_armor(compiled, blocked, flags, runner):
    out, _ = compiled
    result = run_py_without(out, ("dense_armor", "jax", "jaxlib", *blocked), "--iree", *flags)
    assert result.returncode == 0, result.stderr
    assert f"on IREE llvm-cpu modules through {runner}\n" in result.stdout
    assert "(ok)" in result.stdout
    assert re.search(r"iree step B=2, 6 steps +max \|error\| = \d", result.stdout)


def test_a_windowed_pre_ln_decoder_runs_in_iree(tmp_path):
    model = DECODER.build(jax.random.PRNGKey(1))
    export_model(model, DECODER, tmp_path / "art", platforms=["cpu"], static_shapes=[(2, 5, 3)])
    compile_artifact(tmp_path / "art", ["llvm-cpu"], jobs=2)
    errors = check_iree(tmp_path / "art", steps=8)  # past the window of 3: the ring wraps
    assert max(errors.values()) < 1e-5, errors
    assert "iree step B=2 S=3, 8 steps" in errors


def test_a_stack_of_recurrent_and_attention_blocks_runs_in_iree(tmp_path):
    config = ModelConfig(
        "transformer_encoder",
        {**ENCODER.arguments, "depth": 3, "mixers": ["mingru", "attention", "lstm"]},
    )
    model = config.build(jax.random.PRNGKey(2))
    export_model(model, config, tmp_path / "art", platforms=["cpu"], static_shapes=[(2, 5)])
    compile_artifact(tmp_path / "art", ["llvm-cpu"], jobs=2)
    errors = check_iree(tmp_path / "art")
    assert {name.split()[1] for name in errors} == FUNCTIONS
    assert max(errors.values()) < 1e-5, errors


V2 = "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3"
V3 = f"{V2} avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
V4 = f"{V3} avx512f avx512bw avx512cd avx512dq avx512vl"
TARGET_CPU = "--iree-llvmcpu-target-cpu="


@pytest.mark.parametrize(
    "flags, want",
    [  # /proc/cpuinfo's flags: the psABI's level (each includes the one below) and the extras
        ("fpu sse sse2", [f"{TARGET_CPU}x86-64"]),
        (V2, [f"{TARGET_CPU}x86-64-v2"]),
        # a Zen 4 whose virtual machine hides AVX-512 (this suite's AMD machines): AVX2's level
        (f"{V3} sse4a vaes vpclmulqdq sha_ni", [
            f"{TARGET_CPU}x86-64-v3", "--iree-llvmcpu-target-cpu-features=+vaes,+vpclmulqdq"]),
        (V3.replace(" movbe", ""), [f"{TARGET_CPU}x86-64-v2"]),  # a level lacks one feature
        (V4.replace(" sse4_1", ""), [f"{TARGET_CPU}x86-64"]),  # so does every level above it
        (f"{V4} avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16", [  # a Xeon with AMX
            f"{TARGET_CPU}x86-64-v4",
            "--iree-llvmcpu-target-cpu-features=+avx512vnni,+avx512bf16,+amx-tile,+amx-int8,"
            "+amx-bf16"]),
    ],
)  # fmt: skip
def test_the_host_cpu_is_the_instruction_set_the_system_enables(flags, want, monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert host_cpu(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: spectre\n") == want
    assert host_cpu("") == [f"{TARGET_CPU}host"]  # no flags to read: IREE's own
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert host_cpu(f"flags : {V4}") == [f"{TARGET_CPU}host"]


def test_cli_compile_and_refusals(tmp_path, compiled, capsys):
    out, _ = compiled
    model = ENCODER.build(jax.random.PRNGKey(0))
    export_model(model, ENCODER, tmp_path / "art", platforms=["cpu"], static_shapes=[(1, 4)])
    assert cli(["compile", str(tmp_path / "art"), "--target", "llvm-cpu"]) == 0
    printed = capsys.readouterr().out
    assert "checked in IREE's Python runtime (local-task)" in printed
    assert "iree step B=1" in printed
    assert cli(["inspect", str(tmp_path / "art")]) == 0
    assert "IREE modules: 5 (.vmfb) for llvm-cpu" in capsys.readouterr().out
    # only what a deployment runs: the other modules of the target replaced, checked alone
    assert cli(["compile", str(tmp_path / "art"), "--functions", "init_cache,step"]) == 0
    printed = capsys.readouterr().out
    assert "iree step B=1" in printed and "iree forward" not in printed
    assert cli(["inspect", str(tmp_path / "art")]) == 0
    assert "IREE modules: 2 (.vmfb) for llvm-cpu" in capsys.readouterr().out
    with pytest.raises(ArtifactError, match="unknown IREE target 'metal'"):
        compile_artifact(tmp_path / "art", ["metal"])
    with pytest.raises(ArtifactError, match="non-empty list"):
        compile_artifact(tmp_path / "art", "llvm-cpu")
    export_model(model, ENCODER, tmp_path / "bare", platforms=["cpu"], static_shapes=[])
    with pytest.raises(ArtifactError, match="no static modules"):
        compile_artifact(tmp_path / "bare", ["llvm-cpu"])
    with pytest.raises(ArtifactError, match="no IREE llvm-cpu modules"):
        check_iree(tmp_path / "bare")
    # an edited .vmfb is caught before IREE runs it
    vmfb = next((tmp_path / "art" / "static").glob("*.vmfb"))
    vmfb.write_bytes(vmfb.read_bytes()[:-1])
    with pytest.raises(ArtifactError, match="truncated"):
        check_iree(tmp_path / "art")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["compatibility"]["serialization_version"] >= 9


def test_a_bfloat16_model_comes_back_from_iree_in_bfloat16(tmp_path):
    """iree-run-module cannot write bfloat16 to .npy: its outputs come back raw and widened, equal
    to what IREE's Python runtime returns; the error is bfloat16 round-off (vulkan-spirv has no
    bfloat16 at all; it is not tried)."""
    config = ModelConfig(
        "transformer_encoder", {**ENCODER.arguments, "depth": 1, "compute_dtype": "bfloat16"}
    )
    export_model(
        config.build(jax.random.PRNGKey(2)),
        config,
        tmp_path / "art",
        platforms=["cpu"],
        static_shapes=[(1, 4)],
    )
    compile_artifact(tmp_path / "art", ["llvm-cpu"], jobs=2)
    outputs = load(tmp_path / "art").manifest["functions"]["forward"]["outputs"]
    assert outputs[0]["dtype"] == "bfloat16"
    errors = check_iree(tmp_path / "art", runner="python")
    assert 0 < max(errors.values()) < 5e-2, errors  # round-off, not zero and not garbage
    assert check_iree(tmp_path / "art", runner="iree-run-module") == errors
    result = subprocess.run(
        [sys.executable, str(tmp_path / "art" / "run.py"), str(tmp_path / "art"), "--iree"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "(ok)" in result.stdout, result.stdout + result.stderr
