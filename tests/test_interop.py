"""Import from PyTorch without PyTorch: the state dicts of `nn.TransformerEncoder` and
`nn.TransformerDecoder` stacks (post-LN and pre-LN, ReLU and GELU, their own LayerNorm eps,
padding masks) and PyTorch's outputs, committed as data by tests/torch_reference/make_golden.py,
against the imported dense_armor models; the command line; refusals."""

import json
import pathlib

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dense_armor.checkpoints import ModelConfig, load_checkpoint
from dense_armor.cli import main as cli
from dense_armor.export import check_golden, export_checkpoint, load
from dense_armor.interop import InteropError, import_torch

DATA = pathlib.Path(__file__).parent / "data" / "torch"
BASE = {"n_in": 3, "d_model": 16, "n_heads": 4, "d_ff": 32, "depth": 2, "n_out": 5, "max_len": 7,
        "use_bias": True}  # fmt: skip
PRE_LN_GELU = {"norm_first": True, "activation": "gelu", "layer_norm_eps": 1e-6}
CASES = {
    "encoder_post_ln": ModelConfig("transformer_encoder", BASE),
    "encoder_pre_ln_gelu": ModelConfig("transformer_encoder", {**BASE, **PRE_LN_GELU}),
    "decoder_post_ln": ModelConfig("transformer_decoder", {**BASE, "d_context": 16}),
    "decoder_pre_ln_gelu": ModelConfig(
        "transformer_decoder", {**BASE, "d_context": 16, **PRE_LN_GELU}
    ),
}


def outputs(model, config, io):
    if config.factory == "transformer_encoder":
        return jax.vmap(lambda x, v: model(x, mask=v))(io["x"], io["valid"])
    return jax.vmap(lambda x, c, m: model(x, c, context_mask=m))(
        io["x"], io["context"], io["context_valid"]
    )


@pytest.mark.parametrize("case", list(CASES))
def test_imported_models_give_pytorchs_outputs(case):
    config = CASES[case]
    model = import_torch(DATA / f"{case}.safetensors", config)
    io = load_file(str(DATA / f"{case}.io.safetensors"))
    np.testing.assert_allclose(outputs(model, config, io), io["y"], atol=1e-5)
    if config.factory == "transformer_decoder":  # it streams, biases and all
        x, context, mask = io["x"][1], io["context"][1], io["context_valid"][1]
        cache = model.init_cache(context, 7, context_mask=mask)
        y, cache = model.prefill(x[:4], cache)
        more, _ = model.prefill(x[4:], cache)
        np.testing.assert_allclose(np.concatenate([y, more]), io["y"][1], atol=1e-5)


def test_import_torch_from_the_command_line_then_export(tmp_path, capsys):
    config = CASES["encoder_post_ln"]
    (tmp_path / "config.json").write_text(json.dumps(config.to_json()))
    state = DATA / "encoder_post_ln.safetensors"
    args = ["import-torch", str(state), "--config", str(tmp_path / "config.json")]
    assert cli([*args, "--out", str(tmp_path / "ckpt")]) == 0
    assert "imported" in capsys.readouterr().out
    restored = load_checkpoint(tmp_path / "ckpt")
    io = load_file(str(DATA / "encoder_post_ln.io.safetensors"))
    np.testing.assert_allclose(outputs(restored.model, config, io), io["y"], atol=1e-5)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "art", platforms=["cpu"], static_shapes=[])
    artifact = load(tmp_path / "art")
    np.testing.assert_allclose(artifact.forward(io["x"][1:]), io["y"][1:], atol=1e-5)
    assert max(check_golden(artifact).values()) < 1e-5
    assert cli([*args[:2], "--config", str(tmp_path / "none.json"), "--out", "x"]) == 2
    assert "cannot read the config" in capsys.readouterr().err


def test_a_state_dict_that_does_not_fit_is_refused_by_name(tmp_path):
    state = load_file(str(DATA / "encoder_post_ln.safetensors"))
    config = CASES["encoder_post_ln"]
    without_bias = ModelConfig("transformer_encoder", {**BASE, "use_bias": False})
    with pytest.raises(
        InteropError, match=r"no place for \['encoder.layers.0.self_attn.in_proj_bias'"
    ):
        import_torch(state, without_bias)
    missing = {k: v for k, v in state.items() if k != "encoder.layers.1.linear2.weight"}
    with pytest.raises(InteropError, match=r"lacks 'encoder.layers.1.linear2.weight'"):
        import_torch(missing, config)
    with pytest.raises(InteropError, match=r"has layers \[0, 1\]; the model has depth 3"):
        import_torch(state, ModelConfig("transformer_encoder", {**BASE, "depth": 3}))
    wider = ModelConfig("transformer_encoder", {**BASE, "d_ff": 64})
    with pytest.raises(
        InteropError, match=r"'encoder.layers.0.linear1.weight' has shape \(32, 16\).*\(64, 16\)"
    ):
        import_torch(state, wider)
    with pytest.raises(InteropError, match=r"lacks 'input.weight'"):
        import_torch(state, config, {"embed": "input"})
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InteropError, match="cannot read the state dict"):
        import_torch(tmp_path / "bad.safetensors", config)
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(InteropError, match="one stack of layers"):
        import_torch(tmp_path / "foreign.safetensors", config)


def test_attention_dropout_drops_weights_only_in_training():
    """Dropout on the attention weights (PyTorch's `nn.MultiheadAttention(dropout=p)`): the
    weights, dropped and rescaled, times the values, by hand; no key or rate 0: the plain layer."""
    import jax.numpy as jnp

    from dense_armor.utility.neural import MultiHeadSelfAttention, TransformerBlock

    key = jax.random.PRNGKey(0)
    layer = MultiHeadSelfAttention(8, 2, key, causal=True, use_bias=True, attention_dropout=0.25)
    plain = MultiHeadSelfAttention(8, 2, key, causal=True, use_bias=True)
    x = jax.random.normal(key, (6, 8))
    np.testing.assert_allclose(layer(x), plain(x), atol=1e-6)  # no key: inference
    drop_key = jax.random.PRNGKey(5)
    weights = np.asarray(plain.attention_weights(x), np.float64)  # (2, 6, 6)
    keep = np.asarray(jax.random.bernoulli(drop_key, 0.75, weights.shape))
    dropped = np.where(keep, weights / 0.75, 0.0)
    values = np.asarray(x @ plain.W_V.value, np.float64).reshape(6, 2, 4).transpose(1, 0, 2)
    heads = np.einsum("hts,hsd->htd", dropped, values).transpose(1, 0, 2).reshape(6, 8)
    expected = heads @ np.asarray(plain.W_O.value, np.float64)
    np.testing.assert_allclose(layer(x, key=drop_key), expected, atol=1e-5)
    every = MultiHeadSelfAttention(8, 2, key, causal=True, use_bias=True, attention_dropout=1.0)
    np.testing.assert_array_equal(every(x, key=drop_key), np.zeros((6, 8)))  # b_O starts at 0
    block = TransformerBlock(8, 2, 16, key, causal=True, attention_dropout=0.5)
    assert float(jnp.abs(block(x, key=drop_key) - block(x)).max()) > 1e-3
    np.testing.assert_allclose(block(x), TransformerBlock(8, 2, 16, key, causal=True)(x))


def test_cross_attention_dropout_drops_its_weights_only_in_training():
    import jax.numpy as jnp

    from dense_armor.utility.neural import MultiHeadCrossAttention, TransformerDecoderBlock

    key = jax.random.PRNGKey(1)
    layer = MultiHeadCrossAttention(8, 2, key, 5, attention_dropout=0.25)
    plain = MultiHeadCrossAttention(8, 2, key, 5)
    x, context = jax.random.normal(key, (3, 8)), jax.random.normal(key, (4, 5))
    context_mask = jnp.array([True, True, False, True])
    np.testing.assert_allclose(
        layer(x, context, context_mask=context_mask), plain(x, context, context_mask=context_mask)
    )
    drop_key = jax.random.PRNGKey(7)
    q = np.asarray(x @ plain.W_Q.value, np.float64).reshape(3, 2, 4).transpose(1, 0, 2)
    k = np.asarray(context @ plain.W_K.value, np.float64).reshape(4, 2, 4).transpose(1, 0, 2)
    v = np.asarray(context @ plain.W_V.value, np.float64).reshape(4, 2, 4).transpose(1, 0, 2)
    scores = np.where(np.asarray(context_mask), q @ k.transpose(0, 2, 1) / 2.0, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    keep = np.asarray(jax.random.bernoulli(drop_key, 0.75, (1, 2, 3, 4))).reshape(2, 3, 4)
    heads = np.where(keep, weights / 0.75, 0.0) @ v
    expected = heads.transpose(1, 0, 2).reshape(3, 8) @ np.asarray(plain.W_O.value, np.float64)
    got = layer(x, context, context_mask=context_mask, key=drop_key)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    block = TransformerDecoderBlock(8, 2, 16, key, d_context=5, attention_dropout=0.5)
    assert float(jnp.abs(block(x, context, key=drop_key) - block(x, context)).max()) > 1e-3
