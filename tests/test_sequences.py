"""Padding masks, pre-LN blocks, mixed precision, attention weights and sliding windows."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dense_armor.checkpoints import ModelConfig
from dense_armor.export import check_golden, export_model, load
from dense_armor.plots import plot_attention
from dense_armor.utility.neural import (
    Cast,
    LayerNorm,
    MeanOverTime,
    MultiHeadSelfAttention,
    RingKVCache,
    ShapeError,
    TransformerBlock,
    attention_maps,
    transformer_encoder,
)
from reference import attention
from streams import prefix_outputs, stream


def pad(x, total, value=7.0):
    return jnp.concatenate([x, jnp.full((total - x.shape[0], x.shape[1]), value)])


# Padding


@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_equals_each_unpadded_sequence(getkey, causal):
    enc = transformer_encoder(3, 16, 2, 32, 2, 4, getkey(), 12, causal=causal)
    lengths = [12, 7, 3, 1]
    seqs = [jax.random.normal(getkey(), (n, 3)) for n in lengths]
    batch = jnp.stack([pad(s, 12) for s in seqs])
    masks = jnp.stack([jnp.arange(12) < n for n in lengths])
    ys = jax.vmap(lambda x, m: enc(x, mask=m))(batch, masks)
    for y, s in zip(ys, seqs, strict=True):
        np.testing.assert_allclose(y, enc(s), atol=1e-5)
    block = enc.layers[2]
    h = jax.random.normal(getkey(), (12, 16))
    np.testing.assert_allclose(block(h, mask=masks[1])[:7], block(h[:7]), atol=1e-5)


def test_fully_padded_sequences_give_zeros_without_nan(getkey):
    x = jax.random.normal(getkey(), (5, 8))
    none = jnp.zeros(5, bool)
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    np.testing.assert_array_equal(m(x, mask=none), 0.0)
    np.testing.assert_array_equal(MeanOverTime()(x, mask=none), 0.0)
    enc = transformer_encoder(8, 16, 2, 32, 1, 3, getkey(), 8)
    y = enc(x, mask=none)
    np.testing.assert_allclose(y, enc.layers[-1].b.value, atol=1e-6)  # the head applied to 0
    grads = eqx.filter_grad(lambda e: jnp.sum(e(x, mask=none) ** 2))(enc)
    assert all(bool(jnp.all(jnp.isfinite(p.value))) for p in grads.params())


def test_mean_over_valid_steps_by_hand():
    x = jnp.array([[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]])
    np.testing.assert_array_equal(
        MeanOverTime()(x, mask=jnp.array([True, True, False])), [2.0, 4.0]
    )


def test_bad_masks(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey())
    with pytest.raises(ShapeError, match=r"`mask`: expected Bool\['T'\] \| None"):
        m(jnp.ones((5, 8)), mask=jnp.ones(4, bool))
    with pytest.raises(ShapeError, match=r"`mask`.*dtype float32"):
        m(jnp.ones((5, 8)), mask=jnp.ones(5))
    enc = transformer_encoder(3, 8, 2, 16, 1, 2, getkey(), 8)
    with pytest.raises(ShapeError, match="`mask`"):
        enc(jnp.ones((5, 3)), mask=jnp.ones(6, bool))


# Pre-LN


def test_pre_ln_block_by_its_equations(getkey):
    b = TransformerBlock(8, 2, 16, getkey(), causal=True, norm_first=True)
    x = jax.random.normal(getkey(), (6, 8))
    y = x + b.attention(b.norm1(x))
    np.testing.assert_allclose(b(x), y + b.feed_forward(b.norm2(y)), atol=1e-5)
    ys, _ = stream(b, x, b.init_cache(6))
    np.testing.assert_allclose(ys, b(x), atol=1e-5)


def test_pre_ln_encoder_has_a_final_layer_norm_and_streams(getkey):
    enc = transformer_encoder(3, 16, 2, 32, 2, 4, getkey(), 10, causal=True, norm_first=True)
    assert isinstance(enc.layers[-3], LayerNorm)
    assert all(b.norm_first for b in enc.layers[2:4])
    x = jax.random.normal(getkey(), (10, 3))
    cache = enc.init_cache(10, on_overflow="nan")
    step = eqx.filter_jit(enc.step)
    for t in range(10):
        y_t, cache = step(x[t], cache)
    np.testing.assert_allclose(y_t, enc(x), atol=1e-5)


# Mixed precision


def test_bfloat16_compute_tracks_float32(getkey):
    key = getkey()
    f32 = transformer_encoder(3, 32, 4, 64, 2, 4, key, 16)
    b16 = transformer_encoder(3, 32, 4, 64, 2, 4, key, 16, compute_dtype="bfloat16")
    assert isinstance(b16.layers[0], Cast)
    assert all(p.value.dtype == jnp.float32 for p in b16.params())
    xs = jax.random.normal(getkey(), (8, 16, 3))
    y16, y32 = jax.vmap(b16)(xs), jax.vmap(f32)(xs)
    assert y16.dtype == jnp.bfloat16
    # bfloat16 keeps 8 bits of mantissa: a relative tolerance of a few 2**-8
    scale = float(jnp.abs(y32).max())
    assert float(jnp.abs(y16.astype(jnp.float32) - y32).max()) < 3e-2 * scale
    with pytest.raises(ValueError, match="dtype"):
        transformer_encoder(3, 32, 4, 64, 2, 4, key, 16, compute_dtype="int8")


@pytest.mark.optax
def test_bfloat16_model_trains_with_float32_gradients(getkey):
    model = transformer_encoder(3, 16, 2, 32, 1, 2, getkey(), 8, compute_dtype="bfloat16")
    xs = jax.random.normal(getkey(), (32, 8, 3))
    labels = (xs[:, :, 0].mean(axis=1) > 0).astype(jnp.int32)

    def loss_fn(m):
        logits = jax.vmap(m)(xs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, state):
        grads = eqx.filter_grad(loss_fn)(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, grads

    first = float(loss_fn(model))
    for _ in range(30):
        model, state, grads = train_step(model, state)
        assert all(g.value.dtype == jnp.float32 for g in grads.params())
    assert float(loss_fn(model)) < 0.6 * first


def test_bfloat16_streams(getkey):
    enc = transformer_encoder(
        3, 16, 2, 32, 1, 2, getkey(), 8, causal=True, compute_dtype="bfloat16"
    )
    x = jax.random.normal(getkey(), (8, 3))
    cache = enc.init_cache(8)
    for t in range(8):
        y_t, cache = enc.step(x[t], cache)
    assert y_t.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(y_t, np.float32), np.asarray(enc(x), np.float32), atol=5e-2
    )


# Attention weights


def test_attention_weights_match_the_reference(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    x = jax.random.normal(getkey(), (5, 8))
    w = m.attention_weights(x)
    assert w.shape == (2, 5, 5)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert float(jnp.abs(jnp.triu(w, 1)).max()) == 0.0
    q = np.asarray(x @ m.W_Q.value, np.float64)[:, :4]
    k = np.asarray(x @ m.W_K.value, np.float64)[:, :4]
    scores = q @ k.T / 2.0 + np.where(np.tril(np.ones((5, 5))), 0.0, -np.inf)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(w[0], expected / expected.sum(-1, keepdims=True), atol=1e-5)


def test_attention_maps_and_heat_map(getkey, tmp_path):
    enc = transformer_encoder(3, 8, 2, 16, 3, 2, getkey(), 8, causal=True)
    x = jax.random.normal(getkey(), (6, 3))
    maps = attention_maps(enc, x)
    assert len(maps) == 3 and all(m.shape == (2, 6, 6) for m in maps)
    h = enc.layers[1](enc.layers[0](x))
    np.testing.assert_allclose(maps[0], enc.layers[2].attention.attention_weights(h), atol=1e-6)
    path = plot_attention(maps[0], tmp_path / "map.png", head=1, title="block 1")
    assert path.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="head=5"):
        plot_attention(maps[0], tmp_path / "x.png", head=5)
    with pytest.raises(ValueError, match="no TransformerBlock"):
        attention_maps(_only_dense(enc), x)


def _only_dense(enc):
    from dense_armor.utility.neural import Sequential

    return Sequential(enc.layers[0])


# Sliding windows


def test_window_forward_is_a_banded_causal_mask(getkey):
    m = MultiHeadSelfAttention(8, 1, getkey(), causal=True, window=3)
    x = jax.random.normal(getkey(), (7, 8))
    rows, cols = np.arange(7)[:, None], np.arange(7)[None, :]
    band = (cols <= rows) & (cols > rows - 3)
    x64 = np.asarray(x, np.float64)
    w = [np.asarray(p.value, np.float64) for p in m.params()]
    expected = attention(x64 @ w[0], x64 @ w[1], x64 @ w[2], band) @ w[3]
    np.testing.assert_allclose(m(x), expected, atol=1e-5)
    weights = m.attention_weights(x)[0]
    assert float(jnp.abs(jnp.where(band, 0.0, weights)).max()) == 0.0


def test_windowed_encoder_streams_forever_in_constant_memory(getkey):
    window, max_len = 4, 8
    enc = transformer_encoder(3, 16, 2, 32, 2, 4, getkey(), max_len, causal=True, window=window)
    steps = 3 * window + 9  # far past the window, and past max_len
    x = jax.random.normal(getkey(), (steps, 3))
    traces = []

    def tick(m, x_t, cache):
        traces.append(None)
        return m.step(x_t, cache)

    step = jax.jit(tick, donate_argnums=2)
    cache = enc.init_cache()
    shapes = jax.tree_util.tree_map(jnp.shape, cache)
    ys = []
    for t in range(steps):
        y_t, cache = step(enc, x[t], cache)
        ys.append(y_t)
    prefixes = prefix_outputs(enc, x, direct=(0, window, steps - 1))
    np.testing.assert_allclose(jnp.stack(ys), prefixes, atol=2e-5)
    assert len(traces) == 1
    assert jax.tree_util.tree_map(jnp.shape, cache) == shapes
    ring = cache[2]
    assert isinstance(ring, RingKVCache) and ring.keys.shape == (2, window, 8)
    assert int(ring.index) < 2 * window


def test_windowed_learned_positions_stay_bounded(getkey):
    enc = transformer_encoder(
        3, 8, 2, 16, 1, 2, getkey(), 4, causal=True, window=2, positions="learned"
    )
    with pytest.raises(ShapeError, match="max_len=4"):
        enc(jnp.ones((5, 3)))
    cache = enc.init_cache()
    for _ in range(4):
        _, cache = enc.step(jnp.ones(3), cache)
    with pytest.raises(eqx.EquinoxRuntimeError, match="max_len=4"):
        enc.step(jnp.ones(3), cache)[0].block_until_ready()


def test_bad_windows(getkey):
    with pytest.raises(ValueError, match="window"):
        MultiHeadSelfAttention(8, 2, getkey(), causal=True, window=0)
    with pytest.raises(ValueError, match="causal=True"):
        MultiHeadSelfAttention(8, 2, getkey(), window=3)
    windowed = MultiHeadSelfAttention(8, 2, getkey(), causal=True, window=3)
    plain = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    with pytest.raises(ValueError, match="ring cache"):
        windowed.step(jnp.ones(8), plain.init_cache(4))
    with pytest.raises(ValueError, match="ring cache"):
        plain.step(jnp.ones(8), windowed.init_cache())


def small_encoder_config(**options) -> ModelConfig:
    arguments = {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "n_out": 2}
    return ModelConfig(
        "transformer_encoder", {**arguments, "max_len": 6, "causal": True, **options}
    )


def test_export_of_a_pre_ln_windowed_encoder(tmp_path):
    config = small_encoder_config(norm_first=True, window=3)
    model = config.build(jax.random.PRNGKey(0))
    export_model(model, config, tmp_path / "art", platforms=["cpu"], static_shapes=[(1, 6)])
    artifact = load(tmp_path / "art")
    assert max(check_golden(artifact).values()) < 1e-5
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 20, 3))
    cache = artifact.init_cache(2)
    for t in range(20):  # far past the capacity: a ring never overflows
        y_t, cache, overflow = artifact.step(x[:, t], cache)
        assert not bool(overflow.any())
    np.testing.assert_allclose(y_t, jax.vmap(model)(x), atol=1e-5)


def test_export_of_a_bfloat16_encoder(tmp_path):
    config = small_encoder_config(compute_dtype="bfloat16")
    model = config.build(jax.random.PRNGKey(0))
    export_model(model, config, tmp_path / "art", platforms=["cpu"], static_shapes=[(1, 6)])
    artifact = load(tmp_path / "art")
    outputs = artifact.manifest["functions"]["forward"]["outputs"]
    assert outputs[0]["dtype"] == "bfloat16"
    assert max(check_golden(artifact).values()) < 1e-2
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 3))
    y = artifact.forward(np.asarray(x))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(jax.vmap(model)(x), np.float32), atol=2e-2
    )
