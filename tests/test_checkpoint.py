import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dense_armor.checkpoints.single as checkpoint_module
from dense_armor.checkpoints import (
    CheckpointError,
    ModelConfig,
    load_checkpoint,
    save_checkpoint,
    tree_arrays,
)
from dense_armor.export import export_model

CONFIG = ModelConfig(
    "transformer_encoder",
    {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "n_out": 2, "max_len": 12},
)


def same_model(a, b) -> bool:
    wa, wb = tree_arrays(a), tree_arrays(b)
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_round_trip(tmp_path, getkey):
    model = CONFIG.build(getkey())
    path = save_checkpoint(tmp_path / "ckpt", model, CONFIG, state={"step": 3})
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "state.json",
        "weights.safetensors",
    ]
    config = json.loads((path / "config.json").read_text())
    assert config["factory"] == "transformer_encoder" and config["version"] == 1
    weights = load_file(str(path / "weights.safetensors"))
    assert ".layers[0].W.value" in weights
    loaded = load_checkpoint(path)
    assert same_model(loaded.model, model)
    assert loaded.config == CONFIG and loaded.state == {"step": 3}
    x = jax.random.normal(getkey(), (5, 3))
    np.testing.assert_array_equal(loaded.model(x), model(x))


def test_replacing_leaves_no_temporary_files(tmp_path, getkey):
    for _ in range(2):
        save_checkpoint(tmp_path / "ckpt", CONFIG.build(getkey()), CONFIG)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, getkey, monkeypatch):
    first = CONFIG.build(getkey())
    save_checkpoint(tmp_path / "ckpt", first, CONFIG)

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"\x00" * 10)  # a partial file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "write_safetensors", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ckpt", CONFIG.build(getkey()), CONFIG)
    monkeypatch.undo()
    assert same_model(load_checkpoint(tmp_path / "ckpt").model, first)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_crash_between_the_renames_falls_back_to_the_previous(tmp_path, getkey, monkeypatch):
    first = CONFIG.build(getkey())
    save_checkpoint(tmp_path / "ckpt", first, CONFIG)
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # after moving the old one aside, before the new one lands
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ckpt", CONFIG.build(getkey()), CONFIG)
    monkeypatch.undo()
    assert not (tmp_path / "ckpt").exists()
    assert same_model(load_checkpoint(tmp_path / "ckpt").model, first)


def test_weights_that_disagree_with_the_config(tmp_path, getkey):
    """Edited weights in a checkpoint without checksums (as written before they were recorded):
    every structure mismatch is named."""
    path = save_checkpoint(tmp_path / "ckpt", CONFIG.build(getkey()), CONFIG)
    config = json.loads((path / "config.json").read_text())
    del config["files"]
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(path / "weights.safetensors"))
    weights[".layers[0].W.value"] = np.zeros((3, 9), np.float32)
    save_file(weights, str(path / "weights.safetensors"))
    with pytest.raises(CheckpointError, match=r"\.layers\[0\]\.W\.value.*\(3, 9\).*\(3, 8\)"):
        load_checkpoint(path)
    del weights[".layers[0].W.value"]
    save_file(weights, str(path / "weights.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(path)
    weights[".layers[0].W.value"] = np.zeros((3, 8), np.float64)
    save_file(weights, str(path / "weights.safetensors"))
    with pytest.raises(CheckpointError, match="dtype float64"):
        load_checkpoint(path)


def test_bad_checkpoints_fail_clearly(tmp_path, getkey):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing")
    path = save_checkpoint(tmp_path / "ckpt", CONFIG.build(getkey()), CONFIG)
    (path / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        load_checkpoint(path)
    (path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="corrupt JSON"):
        load_checkpoint(path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing file"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="unknown model factory"):
        ModelConfig("resnet", {})


def test_no_pickle_in_the_files(tmp_path, getkey):
    path = save_checkpoint(tmp_path / "ckpt", CONFIG.build(getkey()), CONFIG)
    for file in path.iterdir():
        assert not file.read_bytes().startswith(b"\x80"), file  # a pickle's protocol marker


def test_tree_arrays_keys_are_pytree_paths(getkey):
    arrays = tree_arrays(CONFIG.build(getkey()))
    assert ".layers[2].attention.W_Q.value" in arrays
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    assert not any(jnp.issubdtype(v.dtype, jnp.integer) for v in arrays.values())


def test_checkpoints_and_artifacts_get_the_usual_permissions(tmp_path):
    model = CONFIG.build(jax.random.PRNGKey(0))
    umask = os.umask(0o022)
    try:
        ckpt = save_checkpoint(tmp_path / "ckpt", model, CONFIG)
        art = export_model(model, CONFIG, tmp_path / "art", platforms=["cpu"], static_shapes=[])
    finally:
        os.umask(umask)
    for directory in (ckpt, art.directory, art.directory / "static"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755, directory
    for file in [*ckpt.iterdir(), *art.directory.iterdir()]:
        if file.is_file():
            assert stat.S_IMODE(file.stat().st_mode) == 0o644, file


def test_arrays_in_a_devices_column_major_order_are_written_row_major(tmp_path, monkeypatch):
    """On a TPU `np.asarray(x)` can give a view in the device buffer's layout (a matrix
    column-major); safetensors' writer copies memory as it lies, so every file the package writes
    goes through `write_safetensors`, which makes each array row-major. Here the weights come
    back column-major, as a TPU hands some back: checkpoint, artifact and Hugging Face directory
    still hold the model's values."""
    import ast
    import pathlib

    from dense_armor.checkpoints import tensors as _tensors
    from dense_armor.huggingface import export_hf, import_hf
    from dense_armor.nn.models.language_model import TransformerLM

    arguments = dict(vocab=32, d_model=16, n_heads=2, d_ff=24, depth=1, max_len=8)
    model = TransformerLM(**arguments, key=jax.random.PRNGKey(0))
    config = ModelConfig("transformer_lm", arguments)
    # every shape keeps its own: a scalar (an optimizer's step count), a vector, a matrix
    arrays = {"count": np.int32(7), "bias": np.arange(3.0), "W": np.asfortranarray(np.eye(2, 3))}
    _tensors.write_safetensors(arrays, tmp_path / "shapes.safetensors")
    back = load_file(str(tmp_path / "shapes.safetensors"))
    for name, value in arrays.items():
        assert back[name].shape == np.shape(value), name
        np.testing.assert_array_equal(back[name], value)
    row_major = _tensors.row_major
    monkeypatch.setattr(_tensors, "row_major", lambda a: row_major(np.asfortranarray(a)))
    assert not np.asfortranarray(np.ones((3, 2))).flags.c_contiguous  # what the writer is given
    loaded = load_checkpoint(save_checkpoint(tmp_path / "ckpt", model, config)).model
    written = export_hf(model, arguments, tmp_path / "hf", architecture="LlamaForCausalLM")
    again, _ = import_hf(written)
    for copy in (loaded, again):
        for a, b in zip(model.params(), copy.params(), strict=True):
            np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    # and nothing in the package writes a safetensors file another way
    writer = pathlib.Path(_tensors.__file__)
    for path in writer.parents[1].rglob("*.py"):  # the whole package
        names = {
            node.attr if isinstance(node, ast.Attribute) else node.id
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute | ast.Name)
        }
        assert "save_file" not in names or path == writer, path
