import datetime
import json
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dense_armor.checkpoints import CheckpointError, ModelConfig, save_checkpoint
from dense_armor.cli import main as cli
from dense_armor.export import ArtifactError, check_golden, export_model, load, standalone
from dense_armor.export.standalone import sha256
from environment import child_env, run_py_without
from streams import prefix_outputs

MAX_LEN, CAPACITY = 8, 6
CONFIG = ModelConfig(
    "transformer_encoder",
    {
        "n_in": 3,
        "d_model": 8,
        "n_heads": 2,
        "d_ff": 16,
        "depth": 2,
        "n_out": 4,
        "max_len": MAX_LEN,
        "causal": True,
    },
)


@pytest.fixture(scope="module")
def model():
    return CONFIG.build(jax.random.PRNGKey(7))


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory, model):
    out = tmp_path_factory.mktemp("export") / "artifacts"
    export_model(
        model,
        CONFIG,
        out,
        capacity=CAPACITY,
        platforms=["cpu"],
        static_shapes=[(1, MAX_LEN), (2, 5)],
    )
    return out


@pytest.fixture(scope="module")
def every_platform(tmp_path_factory, model):
    """The one export for cpu, cuda and tpu (lowered on this CPU): platforms are its point."""
    out = tmp_path_factory.mktemp("export") / "every-platform"
    export_model(model, CONFIG, out, capacity=CAPACITY, static_shapes=[(2, 5)])
    return out


@pytest.fixture
def copy(artifact_dir, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(artifact_dir, target)
    return target


def test_layout_and_manifest(artifact_dir, model):
    manifest = json.loads((artifact_dir / "manifest.json").read_text())
    assert manifest["format"] == "dense_armor.export" and manifest["format_version"] == 2
    assert set(manifest["versions"]) == {"dense_armor", "jax", "jaxlib"}
    assert manifest["model"]["arguments"] == dict(CONFIG.arguments)
    forward, step = manifest["functions"]["forward"], manifest["functions"]["step"]
    assert forward["platforms"] == step["platforms"] == ["cpu"]
    n_weights = len(model.params())
    assert [i["role"] for i in forward["inputs"]] == ["weight"] * n_weights + ["input"]
    assert forward["inputs"][-1]["shape"] == ["B", "T", 3]
    assert forward["outputs"][0]["shape"] == ["B", 4]
    roles = [i["role"] for i in step["inputs"]]
    assert roles[: n_weights + 1] == ["weight"] * n_weights + ["input"]
    assert set(roles[n_weights + 1 :]) == {"cache"}
    assert step["donated"] == [i["name"] for i in step["inputs"] if i["role"] == "cache"]
    assert ["B", 2, CAPACITY, 4] in [i["shape"] for i in step["inputs"]]
    streaming = manifest["streaming"]
    assert streaming["capacity"] == CAPACITY and "NaN" in streaming["overflow"]
    assert streaming["model"]["arguments"]["causal"] is True
    # The layout is the model's cache tree: positions, each block's attention cache, the mean.
    layout = {e["path"]: (e["holders"], e["dtype"], e["shape"]) for e in streaming["layout"]}
    assert [e["path"] for e in streaming["layout"]] == [
        i["name"] for i in step["inputs"] if i["role"] == "cache"
    ]
    assert layout["cache[1].counter.index"] == (["PositionCache", "Counter"], "int32", ["B"])
    assert layout["cache[2].keys"][0][-1] == "FixedKVCache"
    assert layout["cache[2].keys"][2] == ["B", 2, CAPACITY, 4]
    assert any(holders[-1] == "MeanCache" for holders, _, _ in layout.values())
    assert all(e["about"] for e in streaming["layout"])
    assert set(manifest["functions"]) == {"forward", "init_cache", "step", "prefill", "reset"}
    for name in ("step", "prefill", "reset"):
        function = manifest["functions"][name]
        assert function["donated"] == [
            i["name"] for i in function["inputs"] if i["role"] == "cache"
        ]
    prefill = manifest["functions"]["prefill"]
    assert prefill["outputs"][0]["shape"] == ["B", "T", 4] and prefill["bounds"]["T"] == [
        1,
        2**31 - 1,
    ]
    init_inputs = manifest["functions"]["init_cache"]["inputs"]
    assert [i["name"] for i in init_inputs if i["role"] != "weight"] == ["streams"]
    assert step["outputs"][-1] == {
        "name": "overflow",
        "role": "output",
        "dtype": "bool",
        "shape": ["B"],
    }
    files = {p.relative_to(artifact_dir).as_posix() for p in artifact_dir.rglob("*") if p.is_file()}
    assert files - {"manifest.json"} == set(manifest["files"])
    statics = {
        (s["function"], s["platform"], tuple(s["shape"].items())) for s in manifest["static"]
    }
    assert ("forward", "cpu", (("B", 2), ("T", 5))) in statics
    assert ("step", "cpu", (("B", 1),)) in statics
    assert ("prefill", "cpu", (("B", 2), ("T", 5))) in statics
    assert ("reset", "cpu", (("B", 2),)) in statics
    assert len(statics) == 5 * 2  # five functions, two shapes
    weights = load_file(str(artifact_dir / "weights.safetensors"))
    assert list(weights) == sorted(manifest["weights"]["names"]) or set(weights) == set(
        manifest["weights"]["names"]
    )


def test_forward_matches_the_python_model(artifact_dir, model):
    artifact = load(artifact_dir)
    forward = jax.jit(jax.vmap(model))  # one compilation per shape, not one per primitive
    for b, t in [(1, 1), (3, 4), (2, MAX_LEN), (5, MAX_LEN)]:
        x = jax.random.normal(jax.random.PRNGKey(b * 10 + t), (b, t, 3))
        np.testing.assert_allclose(artifact.forward(x), forward(x), atol=1e-5)


def test_step_matches_forward_on_every_prefix(artifact_dir, model):
    artifact = load(artifact_dir)
    xs = jax.random.normal(jax.random.PRNGKey(3), (2, CAPACITY, 3))
    cache = artifact.init_cache(np.int64(2))  # a NumPy integer counts streams like an int
    assert [c.shape for c in cache] == [c.shape for c in artifact.init_cache(2)]
    forward = jax.jit(jax.vmap(model))
    for t in range(CAPACITY):
        y_t, cache, overflow = artifact.step(xs[:, t], cache)
        assert not bool(overflow.any())
        np.testing.assert_allclose(y_t, forward(xs[:, : t + 1]), atol=1e-5)


def test_step_reports_overflow_without_callbacks(artifact_dir):
    artifact = load(artifact_dir)
    cache = artifact.init_cache(1)
    x_t = np.ones((1, 3), np.float32)
    for _ in range(CAPACITY):
        y_t, cache, overflow = artifact.step(x_t, cache)
    y_t, cache, overflow = artifact.step(x_t, cache)
    assert bool(overflow[0]) and bool(np.isnan(np.asarray(y_t)).all())
    y_t, cache, overflow = artifact.step(x_t, cache)
    assert bool(overflow[0])


def test_exported_prefill_and_reset_match_the_python_model(artifact_dir, model):
    """prefill(K) then step == forward on every prefix, for chunks of 1, 3 and the capacity;
    a batch of 4 streams where 1 and 3 start again part-way gives, for every stream, what it
    gives alone from its own start."""
    artifact = load(artifact_dir)
    xs = jax.random.normal(jax.random.PRNGKey(3), (4, CAPACITY, 3))
    expected = np.stack([prefix_outputs(model, x, direct=()) for x in xs])  # (4, CAPACITY, 4)
    for chunk in (1, 3, CAPACITY):
        cache = artifact.init_cache(4)
        y, cache, overflow = artifact.prefill(xs[:, :chunk], cache)
        np.testing.assert_allclose(y, expected[:, :chunk], atol=1e-5)
        for t in range(chunk, CAPACITY):
            y_t, cache, overflow = artifact.step(xs[:, t], cache)
            np.testing.assert_allclose(y_t, expected[:, t], atol=1e-5)
        assert not bool(overflow.any())

    restart = 2
    again = jax.random.normal(jax.random.PRNGKey(4), (4, CAPACITY, 3))
    cache = artifact.init_cache(4)
    _, cache, _ = artifact.prefill(xs[:, :restart], cache)
    cache = artifact.reset(cache, np.array([False, True, False, True]))
    rest = CAPACITY - restart
    later = np.where(np.array([0, 1, 0, 1], bool)[:, None, None], again[:, :rest], xs[:, restart:])
    y, cache, overflow = artifact.prefill(later, cache)
    for i in (0, 2):  # untouched: the continuation of their own streams
        np.testing.assert_allclose(y[i], expected[i, restart:], atol=1e-5)
    for i in (1, 3):  # started again: their new sequences alone, from the start
        alone = prefix_outputs(model, again[i, :rest], direct=())
        np.testing.assert_allclose(y[i], alone, atol=1e-5)
    assert not bool(overflow.any())

    # Past the capacity, prefill follows the step's rules: NaN rows and the flag, per stream.
    cache = artifact.init_cache(np.array([True, True]))
    y, cache, overflow = artifact.prefill(np.ones((2, CAPACITY + 2, 3), np.float32), cache)
    assert overflow.tolist() == [True, True]
    assert not np.isnan(np.asarray(y[:, :CAPACITY])).any()
    assert np.isnan(np.asarray(y[:, CAPACITY:])).all()
    cache = artifact.reset(cache, np.array([True, False]))
    y_t, cache, overflow = artifact.step(np.ones((2, 3), np.float32), cache)
    assert overflow.tolist() == [False, True]  # a reset clears its stream's flag, only its own


def test_golden_data_and_the_standalone_runner_without_dense_armor(artifact_dir):
    errors = check_golden(load(artifact_dir))
    assert max(errors.values()) < 1e-5
    assert {"init_cache", "prefill B=2 T=2", "step B=2, 4 steps", "reset at step 4"} <= set(errors)
    # the suite's compilation cache (child_env): the functions compile once
    result = run_py_without(artifact_dir, ("dense_armor",), env=child_env())
    assert result.returncode == 0, result.stderr
    assert "(ok)" in result.stdout and "reset at step 4" in result.stdout


def module_texts(directory):
    return {p.name: p.read_text() for p in (directory / "static").glob("*.mlir")}


# The custom calls jax.export guarantees stable that these modules may use: the guards of the
# symbolic shapes, and a running sum over a symbolic chunk length (the multi-platform prefill).
SYMBOLIC_CUSTOM_CALLS = {"shape_assertion", "stablehlo.dynamic_reduce_window"}


def assert_portable_modules(texts):
    """No host callbacks, no large constants, and no custom calls: none in a static module, and
    in a symbolic one only those of `SYMBOLIC_CUSTOM_CALLS`."""
    for name, text in texts.items():
        targets = set(re.findall(r"custom_call @([\w.]+)", text))
        assert targets <= (set() if name.endswith(".mlir") else SYMBOLIC_CUSTOM_CALLS), (
            name,
            targets,
        )
        assert "callback" not in text, name
        for shape in re.findall(r"stablehlo.constant dense<[^>]*> : tensor<([0-9x]+)x?f32>", text):
            assert np.prod([int(d) for d in shape.split("x") if d]) <= 16, (name, shape)


def test_modules_have_no_callbacks_custom_calls_or_large_constants(artifact_dir):
    artifact = load(artifact_dir)
    texts = {**module_texts(artifact_dir)}
    texts.update({name: f.mlir_module() for name, f in artifact.functions.items()})
    assert_portable_modules(texts)
    static = module_texts(artifact_dir)["forward.cpu.B2.T5.mlir"]
    assert "?" not in re.search(r"func.func public @main\((.*?)\)", static, re.S).group(1)


def test_every_platform_lowers_from_this_machine(every_platform, model):
    artifact = load(every_platform)
    manifest = artifact.manifest
    functions = ("forward", "init_cache", "step", "prefill", "reset")
    for function in functions:
        assert manifest["functions"][function]["platforms"] == ["cpu", "cuda", "tpu"]
    statics = {(s["function"], s["platform"]) for s in manifest["static"]}
    assert statics == {(f, p) for f in functions for p in ("cpu", "cuda", "tpu")}
    texts = {**module_texts(every_platform)}
    texts.update({name: f.mlir_module() for name, f in artifact.functions.items()})
    assert len(texts) == 5 + 5  # the static modules of the three platforms are identical
    assert_portable_modules(texts)
    assert max(check_golden(artifact).values()) < 1e-5  # the cpu lowering of the 3, run here


def test_float32_products_are_exported_at_full_precision(every_platform, model, tmp_path):
    """Every matrix product of every module (the portable and the static, for cuda as for cpu)
    asks for full float32 (a GPU would otherwise run it in TF32, ~1e-3 from the golden
    outputs); `matmul_precision="default"` leaves the platform its own choice."""
    artifact = load(every_platform)
    assert artifact.manifest["matmul_precision"] == "highest"
    texts = {**module_texts(every_platform)}
    texts.update({name: f.mlir_module() for name, f in artifact.functions.items()})
    with_products = 0
    for name, text in texts.items():
        products = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        assert all("precision = [HIGHEST, HIGHEST]" in p for p in products), name
        with_products += bool(products)
    assert with_products >= 6  # forward, step and prefill of both kinds (init_cache has none)
    platform_own = export_model(
        model, CONFIG, tmp_path / "own", platforms=["cuda"], static_shapes=[(1, 4)],
        matmul_precision="default",
    )  # fmt: skip
    assert platform_own.manifest["matmul_precision"] == "default"
    own = module_texts(tmp_path / "own")
    forward = next(text for name, text in own.items() if name.startswith("forward."))
    assert "stablehlo.dot_general" in forward and "HIGHEST" not in forward
    assert platform_own.manifest["precision"]["accelerator_tolerance"] >= 2e-2


def test_an_accelerator_is_held_to_the_manifest_s_own_tolerance(every_platform):
    """On a CPU the checkers hold float32 artifacts to 1e-4; on an accelerator (whose float32
    exp, log and logistic are approximations) to 2**-11 of the largest golden output where
    that is more: both written in the manifest, read by run.py's `checkers_tolerance` (and the
    C runner, which prints the platform it compared on)."""
    artifact = load(every_platform)
    golden = load_file(str(every_platform / "golden.safetensors"))
    largest = max(float(np.abs(a).max()) for a in golden.values() if a.dtype.kind == "f")
    precision = artifact.manifest["precision"]
    assert precision["tolerance"] == 1e-4
    assert precision["accelerator_tolerance"] == pytest.approx(max(1e-4, largest / 2048))
    assert standalone.checkers_tolerance(artifact.manifest, "cpu") == 1e-4
    for platform in ("tpu", "cuda"):
        assert standalone.checkers_tolerance(artifact.manifest, platform) == pytest.approx(
            max(1e-4, largest / 2048)
        )


def test_weights_are_arguments_not_constants(artifact_dir, model):
    artifact = load(artifact_dir)
    n_weights = len(model.params())
    assert len(artifact.functions["forward"].in_avals) == n_weights + 1
    main = re.search(
        r"func.func public @main\((.*?)\) ->",
        module_texts(artifact_dir)["forward.cpu.B1.T8.mlir"],
        re.S,
    )
    assert main.group(1).count("%arg") == n_weights + 1


def test_non_causal_model_exports_the_step_of_its_causal_form(tmp_path):
    config = ModelConfig("transformer_encoder", {**CONFIG.arguments, "causal": False, "depth": 1})
    model = config.build(jax.random.PRNGKey(1))
    export_model(model, config, tmp_path / "art", platforms=["cpu"], static_shapes=[(1, 2)])
    artifact = load(tmp_path / "art")
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 3))
    np.testing.assert_allclose(artifact.forward(x), jax.vmap(model)(x), atol=1e-5)
    assert artifact.manifest["streaming"]["model"]["arguments"]["causal"] is True
    assert max(check_golden(artifact).values()) < 1e-5


def test_bad_files_fail_clearly(copy):
    (copy / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ArtifactError, match="not a dense_armor export manifest"):
        load(copy)
    (copy / "manifest.json").write_text("{ not json")
    with pytest.raises(ArtifactError, match="corrupt"):
        load(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="not a dense_armor artifact"):
        load(copy)


def test_unknown_format_version(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(ArtifactError, match="format version 3"):
        load(copy)
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(ArtifactError, match=r"format version 1.*export the model again"):
        load(copy)


def test_corrupted_truncated_and_missing_files(copy):
    data = bytearray((copy / "step.jax_exported").read_bytes())
    data[100] ^= 0xFF
    (copy / "step.jax_exported").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        load(copy)
    (copy / "weights.safetensors").write_bytes((copy / "weights.safetensors").read_bytes()[:-8])
    with pytest.raises(ArtifactError, match="truncated"):
        load(copy)
    (copy / "golden.safetensors").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        load(copy)


def test_wrong_inputs_to_loaded_functions(artifact_dir):
    artifact = load(artifact_dir)
    with pytest.raises(ArtifactError, match=r"'x' must have shape \('B', 'T', 3\).*\(2, 4, 5\)"):
        artifact.forward(np.ones((2, 4, 5), np.float32))
    with pytest.raises(ArtifactError, match=r"dtype float32.*float64"):
        artifact.forward(np.ones((2, 4, 3), np.float64))
    with pytest.raises(ArtifactError, match=r"T=9 is outside the exported range \[1, 8\]"):
        artifact.forward(np.ones((1, 9, 3), np.float32))
    cache = artifact.init_cache(2)
    with pytest.raises(
        ArtifactError, match=r"cache\[1\]\.counter\.index' has B=2, but an earlier input has B=1"
    ):
        artifact.step(np.ones((1, 3), np.float32), cache)
    with pytest.raises(ArtifactError, match=r"step: expected \d+ inputs \(x_t, cache"):
        artifact.step(np.ones((2, 3), np.float32), cache[:-1])


def test_refuses_an_existing_output_and_bad_arguments(artifact_dir, model, tmp_path):
    with pytest.raises(ArtifactError, match="exists"):
        export_model(model, CONFIG, artifact_dir)
    with pytest.raises(ArtifactError, match="platforms"):
        export_model(model, CONFIG, tmp_path / "x", platforms=["rocm"])
    with pytest.raises(ArtifactError, match="static shape"):
        export_model(model, CONFIG, tmp_path / "x", static_shapes=[(1, MAX_LEN + 1)])
    other = ModelConfig("transformer_encoder", {**CONFIG.arguments, "d_model": 16})
    with pytest.raises(CheckpointError, match="shape"):
        export_model(model, other, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_cli_export_and_inspect(tmp_path, model, capsys):
    save_checkpoint(tmp_path / "ckpt", model, CONFIG)
    out = tmp_path / "art"
    args = [
        "export",
        str(tmp_path / "ckpt"),
        "--out",
        str(out),
        "--platforms",
        "cpu",
        "--static",
        "1,4",
    ]
    assert cli(args) == 0
    assert "weights.safetensors" in capsys.readouterr().out
    assert cli(args) == 2
    assert "exists" in capsys.readouterr().err
    assert cli([*args, "--force", "--capacity", "3"]) == 0
    assert load(out).manifest["streaming"]["capacity"] == 3
    capsys.readouterr()
    assert cli(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sha256 verified" in text and "x_t: float32('B', 3)" in text
    (out / "run.py").write_text("tampered")
    assert cli(["inspect", str(out)]) == 2
    assert "run.py" in capsys.readouterr().err
    assert cli(["export", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    with pytest.raises(SystemExit):
        cli(["export", str(tmp_path / "ckpt"), "--out", str(out), "--static", "8"])


DECODER = ModelConfig(
    "transformer_decoder",
    {
        "n_in": 3,
        "d_model": 8,
        "n_heads": 2,
        "d_ff": 16,
        "depth": 2,
        "n_out": 4,
        "max_len": MAX_LEN,
        "d_context": 5,
        "gate": True,
    },
)


def test_decoder_with_cross_attention_exports_forward_init_and_step(tmp_path):
    model = DECODER.build(jax.random.PRNGKey(4))
    export_model(
        model,
        DECODER,
        tmp_path / "art",
        capacity=CAPACITY,
        platforms=["cpu"],
        static_shapes=[(1, MAX_LEN, 3)],
    )
    artifact = load(tmp_path / "art")
    manifest = artifact.manifest
    assert manifest["kind"] == "decoder"
    assert set(manifest["functions"]) == {"forward", "init_cache", "step", "prefill", "reset"}
    assert [
        i["name"] for i in manifest["functions"]["init_cache"]["inputs"] if i["role"] != "weight"
    ] == ["context", "context_mask"]
    forward_inputs = [
        i for i in manifest["functions"]["forward"]["inputs"] if i["role"] != "weight"
    ]
    assert [i["shape"] for i in forward_inputs] == [["B", "T", 3], ["B", "S", 5], ["B", "S"]]
    assert ("step", "cpu", (("B", 1), ("S", 3))) in {
        (s["function"], s["platform"], tuple(s["shape"].items())) for s in manifest["static"]
    }
    x = jax.random.normal(jax.random.PRNGKey(5), (2, MAX_LEN, 3))
    context = jax.random.normal(jax.random.PRNGKey(6), (2, 4, 5))
    mask = np.array([[True, True, True, False], [True, True, True, True]])
    expected = jax.vmap(lambda x, c, m: model(x, c, context_mask=m))(x, context, mask)
    np.testing.assert_allclose(artifact.forward(x, context, mask), expected, atol=1e-5)
    cache = artifact.init_cache(context, mask)
    for t in range(CAPACITY):
        y_t, cache, overflow = artifact.step(x[:, t], cache)
        assert not bool(overflow.any())
        np.testing.assert_allclose(y_t, expected[:, t], atol=1e-5)
    assert max(check_golden(artifact).values()) < 1e-5
    with pytest.raises(ArtifactError, match="has S=3, but an earlier input has S=4"):
        artifact.forward(x, context, mask[:, :3])


def test_export_of_a_pre_ln_windowed_decoder(tmp_path):
    config = ModelConfig(
        "transformer_decoder", {**DECODER.arguments, "depth": 1, "norm_first": True, "window": 3}
    )
    model = config.build(jax.random.PRNGKey(4))
    export_model(model, config, tmp_path / "art", platforms=["cpu"], static_shapes=[])
    artifact = load(tmp_path / "art")
    assert max(check_golden(artifact).values()) < 1e-5
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 10, 3))  # past the capacity: a ring
    context = jax.random.normal(jax.random.PRNGKey(6), (2, 4, 5))
    mask = np.ones((2, 4), bool)
    expected = jax.vmap(lambda x, c: model(x, c))(x, context)
    cache = artifact.init_cache(context, mask)
    for t in range(10):
        y_t, cache, overflow = artifact.step(x[:, t], cache)
        assert not bool(overflow.any())
        np.testing.assert_allclose(y_t, expected[:, t], atol=1e-5)


def test_a_replacement_killed_between_its_renames_leaves_the_old_artifact_loadable(
    artifact_dir, tmp_path, model
):
    out = tmp_path / "art"
    shutil.copytree(artifact_dir, out)
    out.rename(tmp_path / "art.previous")  # the state a kill after "moved aside" leaves
    np.testing.assert_allclose(
        load(out).forward(np.ones((1, 4, 3), np.float32)),
        jax.vmap(model)(np.ones((1, 4, 3), np.float32)),
        atol=1e-5,
    )
    export_model(model, CONFIG, out, platforms=["cpu"], static_shapes=[], force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # put back, then replaced
    assert max(check_golden(load(out)).values()) < 1e-5


def test_cli_and_api_export_the_same_bytes_and_no_paths(tmp_path, model, monkeypatch):
    """Export is deterministic and debug locations are stripped: two exports of one model, one
    by the API and one by the CLI from a checkpoint, are the same bytes, file for file, manifest
    included; they depend on the model only, not on the calling script or where the sources lie
    (nor on the day, with `SOURCE_DATE_EPOCH` set)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764633599")  # 2025-12-01 23:59:59 UTC
    save_checkpoint(tmp_path / "ckpt", model, CONFIG)
    options = {"capacity": CAPACITY, "platforms": ["cpu", "cuda"], "static_shapes": [(1, 4)]}
    api = export_model(model, CONFIG, tmp_path / "api", **options)
    args = ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "cli"), "--static", "1,4"]
    assert cli([*args, "--capacity", str(CAPACITY), "--platforms", "cpu,cuda"]) == 0
    assert api.manifest["debug_locations"] == "stripped"
    assert api.manifest["created"] == "2025-12-01"
    for file in (tmp_path / "api").rglob("*"):
        if file.is_file():
            other = tmp_path / "cli" / file.relative_to(tmp_path / "api")
            assert file.read_bytes() == other.read_bytes(), file.name
    for name, function in load(tmp_path / "api").functions.items():
        assert ".py" not in function.mlir_module(), name
    assert not any(".py" in t for t in module_texts(tmp_path / "api").values())
    # the cuda lowering of each static module is the cpu one: written once, referenced twice
    entries = api.manifest["static"]
    assert len(entries) == 2 * 5 and len({e["bytecode"] for e in entries}) == 5


def test_a_manifest_that_lies_is_refused(copy, capsys):
    manifest = json.loads((copy / "manifest.json").read_text())
    edited = json.loads(json.dumps(manifest))
    cache_input = next(
        i for i in edited["functions"]["step"]["inputs"] if i["name"].endswith("keys")
    )
    cache_input["shape"][-1] += 1
    (copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(ArtifactError, match=r"step: the manifest says input 'cache\[2\]\.keys'"):
        load(copy)
    assert cli(["inspect", str(copy)]) == 2
    assert "the manifest says input" in capsys.readouterr().err
    edited = json.loads(json.dumps(manifest))
    weight = edited["functions"]["forward"]["inputs"][0]
    weight["dtype"] = "float16"
    (copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(ArtifactError, match="forward: the manifest says input"):
        load(copy)
    for key in ("files", "weights", "functions", "golden", "streaming", "compatibility"):
        edited = {k: v for k, v in manifest.items() if k != key}
        (copy / "manifest.json").write_text(json.dumps(edited))
        with pytest.raises(ArtifactError, match=f"lacks the key `{key}`"):
            load(copy)
    edited = json.loads(json.dumps(manifest))
    del edited["functions"]["prefill"]["outputs"]
    (copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(ArtifactError, match=r"lacks the key `functions\.prefill\.outputs`"):
        load(copy)
    # a weights file replaced by one of another shape, its manifest entry updated to match
    weights = load_file(str(copy / "weights.safetensors"))
    name = manifest["weights"]["names"][0]
    save_file({**weights, name: np.zeros((1, 1), np.float32)}, str(copy / "weights.safetensors"))
    edited = json.loads(json.dumps(manifest))
    edited["files"]["weights.safetensors"] = {
        "sha256": sha256(copy / "weights.safetensors"),
        "bytes": (copy / "weights.safetensors").stat().st_size,
    }
    (copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(ArtifactError, match=f"the weights file holds {re.escape(repr(name))}"):
        load(copy)


def test_export_refuses_a_capacity_past_max_len_unless_windowed(tmp_path, model):
    with pytest.raises(ArtifactError, match=r"capacity 9 > max_len 8.*positional encoding"):
        export_model(model, CONFIG, tmp_path / "x", capacity=MAX_LEN + 1)
    assert not (tmp_path / "x").exists()
    windowed = ModelConfig("transformer_encoder", {**CONFIG.arguments, "depth": 1, "window": 3})
    export_model(
        windowed.build(jax.random.PRNGKey(0)),
        windowed,
        tmp_path / "w",
        capacity=MAX_LEN + 4,
        platforms=["cpu"],
        static_shapes=[],
    )
    artifact = load(tmp_path / "w")
    assert max(check_golden(artifact).values()) < 1e-5  # 12 steps: past max_len, no overflow


def test_compatibility_is_recorded_and_inspect_warns_once_it_has_passed(copy, capsys):
    manifest = json.loads((copy / "manifest.json").read_text())
    compatibility = manifest["compatibility"]
    exported = datetime.date.fromisoformat(compatibility["exported_on"])
    until = datetime.date.fromisoformat(compatibility["newer_jax_guaranteed_until"])
    assert (until - exported).days == 180 and compatibility["exported_with_jax"] == jax.__version__
    assert cli(["inspect", str(copy)]) == 0
    text = capsys.readouterr().out
    assert f"guaranteed to load it until {until}" in text and "warning" not in text
    compatibility["newer_jax_guaranteed_until"] = "2020-01-01"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert cli(["inspect", str(copy)]) == 0
    assert "warning: 2020-01-01 has passed" in capsys.readouterr().out


def test_t_past_max_len_through_bare_jax_export_and_through_load(artifact_dir):
    """What the docs say a consumer sees: jax.export's own error, and load()'s clear one."""
    artifact = load(artifact_dir)
    x = np.ones((1, MAX_LEN + 1, 3), np.float32)
    with pytest.raises(ValueError, match="Error refining shapes"):
        artifact.functions["forward"].call(artifact.weights, x)
    with pytest.raises(ArtifactError, match=r"T=9 is outside the exported range \[1, 8\]"):
        artifact.forward(x)


COMMITTED = pathlib.Path(__file__).parent / "data" / "artifact-v2"


def test_an_artifact_exported_by_an_earlier_release_still_loads_and_runs():
    """tests/data/artifact-v2 was exported by dense_armor 0.1.0 (format version 2) and is never
    regenerated: a change of format or of jax that breaks deployed artifacts fails here."""
    artifact = load(COMMITTED)
    assert artifact.manifest["format_version"] == 2
    assert max(check_golden(artifact).values()) < 1e-5
    cache = artifact.init_cache(3)
    y, cache, overflow = artifact.prefill(np.ones((3, 4, 3), np.float32), cache)
    assert y.shape == (3, 4, 4) and not bool(overflow.any())


def test_the_seed_draws_the_golden_inputs_and_any_seed_is_checked_alike(
    tmp_path, model, artifact_dir
):
    """The golden inputs come from `seed` (the default 0 for `artifact_dir`; that one seed draws
    the same inputs is the export's determinism, checked above): another seed, one past 64 bits
    included, draws other inputs of the same shapes, whose outputs the artifact reproduces as
    well."""
    default = load_file(str(artifact_dir / "golden.safetensors"))
    drawn = re.compile(r"(forward\d|stream)\.x|static\.(forward|step|prefill)\.B2\.T5\.in0")
    options = {"capacity": CAPACITY, "platforms": ["cpu"], "static_shapes": [(2, 5)]}
    for seed in (1, 2**70):
        out = export_model(model, CONFIG, tmp_path / str(seed), seed=seed, **options).directory
        golden = load_file(str(out / "golden.safetensors"))
        inputs = sorted(k for k in golden if drawn.fullmatch(k))
        assert inputs == sorted(k for k in default if drawn.fullmatch(k)) and len(inputs) == 6
        for k in inputs:
            assert golden[k].shape == default[k].shape and not np.array_equal(golden[k], default[k])
        assert max(check_golden(load(out)).values()) < 1e-5
