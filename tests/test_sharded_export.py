"""An artifact laid out over several devices (`export_model(..., mesh=)`, `export --mesh
model=N`): its modules carry their shardings, `run.py` replays it over N simulated CPU devices
against one device's golden outputs, and the runtimes of one device refuse it by name."""

import json
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractMesh
from safetensors.numpy import load_file

from dense_armor.checkpoints import ModelConfig, save_checkpoint
from dense_armor.cli import main as cli
from dense_armor.export import ArtifactError, export_model, load, standalone
from dense_armor.export.iree import compile_artifact
from dense_armor.export.layout import export_mesh
from dense_armor.export.standalone import build_runner, check_iree, default_plugin, run_pjrt
from dense_armor.nn.models.generation import generate
from environment import child_env

DEVICES = 4
# grouped queries: 8 heads, 4 key/value heads, one of each per device
CONFIG = ModelConfig(
    "transformer_lm",
    {"vocab": 64, "d_model": 32, "n_heads": 8, "n_kv_heads": 4, "d_ff": 64, "depth": 2,
     "max_len": 16},
)  # fmt: skip
CAPACITY = 12


@pytest.fixture(scope="module")
def model():
    return CONFIG.build(jax.random.PRNGKey(11))


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory, model):
    """The model exported from the command line over 4 devices, on this one-device process."""
    work = tmp_path_factory.mktemp("laid-out")
    save_checkpoint(work / "checkpoint", model, CONFIG)
    out = work / "artifact"
    cli(
        ["export", str(work / "checkpoint"), "--out", str(out), "--platforms", "cpu",
         "--static", "2,5", "--capacity", str(CAPACITY), "--mesh", f"model={DEVICES}"]
    )  # fmt: skip
    return out


def test_the_modules_carry_their_shardings_for_four_devices(laid_out, model):
    manifest = json.loads((laid_out / "manifest.json").read_text())
    assert manifest["mesh"]["devices"] == DEVICES
    assert manifest["mesh"]["axes"] == {"data": 1, "model": DEVICES}
    step = manifest["functions"]["step"]
    sharding = {s["name"]: s["sharding"] for s in step["inputs"] + step["outputs"]}
    block = ".blocks[0].attention"
    # the plan of the sharding page: queries, keys and values split by output columns (heads),
    # the output projection by its input rows, the tables and norms whole
    assert sharding[f"{block}.W_Q.value"] == [None, "model"]
    assert sharding[f"{block}.W_K.value"] == [None, "model"]
    assert sharding[f"{block}.W_O.value"] == ["model", None]
    assert sharding[".embed.table.value"] == [None, None]
    keys = [name for name in sharding if name.endswith(".keys")]
    assert keys and all(sharding[k] == [None, "model", None, None] for k in keys)  # kv heads
    assert sharding["x_t"] == [None] and sharding["y_t"] == [None, None]
    for name, spec in manifest["functions"].items():
        portable = export.deserialize(bytearray((laid_out / spec["file"]).read_bytes()))
        assert portable.nr_devices == DEVICES, name
    for entry in manifest["static"]:
        text = (laid_out / entry["text"]).read_text()
        assert f"mhlo.num_partitions = {DEVICES}" in text, entry["text"]
    step_text = next(
        (laid_out / e["text"]).read_text() for e in manifest["static"] if e["function"] == "step"
    )
    assert 'sdy.sharding<@mesh, [{}, {"model"}]>' in step_text
    # the weights are the model's own, whole: the layout is the modules', not the file's
    stored = load_file(laid_out / "weights.safetensors")
    assert stored[f"{block}.W_Q.value"].shape == (32, 32)
    np.testing.assert_array_equal(stored[f"{block}.W_Q.value"], model.blocks[0].attention.W_Q.value)


def test_the_golden_outputs_are_one_devices(laid_out, model):
    """Computed here, on this process's one device, from the Python model."""
    manifest = json.loads((laid_out / "manifest.json").read_text())
    golden = load_file(laid_out / "golden.safetensors")
    case = manifest["golden"]["forward"][0]
    x = golden[case["inputs"][0]]
    y = np.stack([np.asarray(model(row)) for row in x])
    np.testing.assert_allclose(golden[case["output"]], y, atol=1e-5)
    plan = manifest["golden"]["generation"]
    tokens = generate(model, golden[plan["prompt"]], plan["new_tokens"], capacity=CAPACITY)
    np.testing.assert_array_equal(golden[plan["tokens"]], np.asarray(tokens.tokens))


def test_run_py_replays_it_over_four_simulated_devices(laid_out, tmp_path):
    """`python run.py DIR` alone (no XLA_FLAGS of its caller): it simulates the four devices."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(laid_out / "run.py"), str(laid_out), "--steps", str(CAPACITY + 2),
         "--report", str(report)],
        capture_output=True, text=True, env=child_env(), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"on {DEVICES} cpu devices" in done.stdout
    errors = json.loads(report.read_text())["errors"]
    assert errors["decode B=2, 8 tokens (tokens that differ)"] == 0
    assert any(name.startswith("step B=2, 2 steps past") for name in errors)
    assert max(errors.values()) < 1e-5, errors


def test_too_few_devices_or_an_edited_mesh_is_refused_by_name(laid_out, tmp_path):
    """Two simulated devices for a four-device artifact: run.py exits 2 naming the count; a
    manifest whose mesh was removed no longer matches its modules."""
    done = subprocess.run(
        [sys.executable, str(laid_out / "run.py"), str(laid_out)], capture_output=True,
        text=True, timeout=300,
        env=child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"laid out for {DEVICES} devices" in done.stderr and "2 CPU device(s)" in done.stderr
    edited = tmp_path / "edited"
    shutil.copytree(laid_out, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    del manifest["mesh"]
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=rf"run on 1 device\(s\); .* laid out for {DEVICES}"):
        load(edited)
    # a mesh entry of the wrong kinds: refused by name, by run.py and the runtimes alike
    for mesh in (
        {"axes": {"model": "four"}, "devices": 4},
        {"axes": {"model": 4}, "devices": 2},
        {"axes": [4], "devices": 4},
        "model=4",
        {"axes": {"model": True}, "devices": 1},
    ):
        manifest["mesh"] = mesh
        (edited / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match=r"`mesh` must give `axes`"):
            load(edited)
        assert standalone.main([str(edited)]) == 2
        with pytest.raises(ArtifactError, match=r"`mesh` must give `axes`"):
            run_pjrt(edited)


def test_a_process_with_one_device_loads_it_but_cannot_call_it(laid_out, capsys):
    artifact = load(laid_out)  # the files verified, the modules deserialized and checked
    with pytest.raises(ArtifactError, match=rf"laid out for {DEVICES} devices.*run.py"):
        artifact.init_cache(2)
    assert cli(["inspect", str(laid_out)]) == 0
    assert f"laid out over {DEVICES} devices" in capsys.readouterr().out


def test_the_runtimes_of_one_device_refuse_it_by_name(laid_out, tmp_path):
    for check, name in (
        (lambda: run_pjrt(laid_out), "the C runner"),
        (lambda: check_iree(laid_out), "IREE"),
        (lambda: compile_artifact(laid_out), "IREE"),
    ):
        with pytest.raises(ArtifactError, match=rf"laid out for {DEVICES} devices.*{name}"):
            check()
    # runner.c itself, built and run by hand as a deployment would
    build_runner(laid_out, tmp_path / "runner")
    done = subprocess.run(
        [str(tmp_path / "runner"), str(laid_out), "--plugin", str(default_plugin())],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert re.search(rf"laid out for {DEVICES} devices.*runs one device's modules", done.stderr)
    assert standalone.main([str(laid_out), "--pjrt"]) == 2


def test_bad_meshes_are_refused_before_any_work(model, tmp_path):
    out = tmp_path / "never"
    cases = [
        (True, "must be a jax.sharding.Mesh"),
        (AbstractMesh((2, 2), ("data", "model")), '"data" axis holds 2'),
        (AbstractMesh((4,), ("heads",)), r"axes are \(\"model\",\) or"),
        # 4 key/value heads over 8 devices: the layer's keys are named
        (AbstractMesh((8,), ("model",)), "W_K"),
    ]
    for mesh, message in cases:
        with pytest.raises(ArtifactError, match=message):
            export_model(model, CONFIG, out, platforms=["cpu"], static_shapes=[], mesh=mesh)
        assert not out.exists()
    assert export_mesh(AbstractMesh((1,), ("model",))) is None  # one device: a plain artifact
    with pytest.raises(SystemExit):
        cli(["export", str(tmp_path), "--out", str(out), "--mesh", "model=0"])


def test_a_scanned_model_with_an_int8_cache_replays_over_two_devices(tmp_path):
    """Stacked layers (their caches one array per kind, the layer axis first) and an int8 cache
    (its scales split with their heads)."""
    config = ModelConfig(
        "transformer_lm", {**CONFIG.arguments, "n_kv_heads": 2, "scan_layers": True}
    )
    model = config.build(jax.random.PRNGKey(12))
    out = tmp_path / "scanned"
    summary = export_model(
        model, config, out, capacity=CAPACITY, platforms=["cpu"], static_shapes=[],
        kv_dtype="int8", mesh=AbstractMesh((2,), ("model",)),
    )  # fmt: skip
    step = {s["name"]: s for s in summary.manifest["functions"]["step"]["inputs"]}
    assert step[".blocks.stacked.attention.W_Q.value"]["sharding"] == [None, None, "model"]
    for name in ("cache[1].keys", "cache[1].key_scale", "cache[1].values"):
        assert step[name]["dtype"] in ("int8", "float32")
        assert step[name]["sharding"] == [None, None, "model", None, None], name
    done = subprocess.run(
        [sys.executable, str(out / "run.py"), str(out)],
        capture_output=True, text=True, env=child_env(), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 cpu devices" in done.stdout and "(tokens that differ) max |error| = 0.000e+00" in (
        done.stdout
    )
