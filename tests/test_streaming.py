import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.utility.neural import (
    AddPositions,
    FixedKVCache,
    KVCache,
    LearnedPositions,
    MultiHeadSelfAttention,
    ShapeError,
    TransformerBlock,
    transformer_encoder,
)
from streams import prefix_outputs, stream


def test_growing_cache_is_two_empty_arrays(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    cache = m.init_cache()
    assert isinstance(cache, KVCache)
    keys, values = cache
    assert keys.shape == values.shape == (0, 8)
    _, cache = m.step(jnp.ones(8), cache)
    _, cache = m.step(jnp.ones(8), cache)
    assert cache.keys.shape == cache.values.shape == (2, 8)


def test_fixed_cache_layout(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    cache = m.init_cache(16)
    assert isinstance(cache, FixedKVCache)
    assert cache.keys.shape == cache.values.shape == (2, 16, 4)  # (n_heads, capacity, d_head)
    assert cache.capacity == 16 and int(cache.index) == 0 and not bool(cache.overflow)
    x = jax.random.normal(getkey(), (3, 8))
    _, cache = stream(m, x, cache)
    assert int(cache.index) == 3
    per_head = (x @ m.W_K.value).reshape(3, 2, 4).transpose(1, 0, 2)
    np.testing.assert_allclose(cache.keys[:, :3], per_head, atol=1e-6)
    np.testing.assert_array_equal(cache.keys[:, 3:], 0.0)


@pytest.mark.parametrize("capacity, length", [(None, 16), (64, 64), (80, 64)])
def test_attention_step_equals_forward_up_to_64(getkey, capacity, length):
    m = MultiHeadSelfAttention(16, 4, getkey(), causal=True)
    x = jax.random.normal(getkey(), (length, 16))
    ys, _ = stream(m, x, m.init_cache(capacity), eqx.filter_jit(m.step))
    np.testing.assert_allclose(ys, m.forward(x), atol=1e-5)


@pytest.mark.parametrize("capacity", [None, 12, 40])
def test_block_step_equals_forward(getkey, capacity):
    b = TransformerBlock(8, 2, 16, getkey(), causal=True)
    x = jax.random.normal(getkey(), (12, 8))
    ys, _ = stream(b, x, b.init_cache(capacity))
    np.testing.assert_allclose(ys, b.forward(x), atol=1e-5)


@pytest.mark.parametrize(
    "depth, capacity, positions",
    [(1, None, "sinusoidal"), (1, 10, "learned"), (3, 10, "sinusoidal"), (3, 33, "learned")],
)
def test_encoder_step_equals_forward_on_every_prefix(getkey, depth, capacity, positions):
    enc = transformer_encoder(4, 8, 2, 16, depth, 3, getkey(), 32, causal=True, positions=positions)
    x = jax.random.normal(getkey(), (10, 4))
    step = enc.step if capacity is None else eqx.filter_jit(enc.step)
    ys, _ = stream(enc, x, enc.init_cache(capacity, on_overflow="nan"), step)
    np.testing.assert_allclose(ys, prefix_outputs(enc, x), atol=2e-5)


def test_positions_step_adds_the_row_of_the_counter(getkey):
    learned = LearnedPositions(8, 4, getkey())
    x = jax.random.normal(getkey(), (5, 4))
    for layer in (AddPositions(8), learned):
        ys, cache = stream(layer, x, layer.init_cache())
        np.testing.assert_array_equal(ys, layer.forward(x))
        assert int(cache.index) == 5


def test_one_compilation_for_many_steps_and_the_cache_is_donated(getkey):
    enc = transformer_encoder(4, 8, 2, 16, 2, 3, getkey(), 128, causal=True)
    traces = []

    def step(model, x_t, cache):
        traces.append(None)
        return model.step(x_t, cache)

    jitted = jax.jit(step, donate_argnums=2)
    cache = enc.init_cache(128)
    xs = jax.random.normal(getkey(), (120, 4))
    for x_t in xs:
        old = cache
        y, cache = jitted(enc, x_t, cache)
    assert len(traces) == 1
    attention_cache = old[2]
    assert attention_cache.keys.is_deleted()
    np.testing.assert_allclose(y, enc.forward(xs), atol=2e-5)


def test_growing_cache_recompiles_at_every_length(getkey):
    """The documented cost of the page's cache: one trace per length."""
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    traces = []

    def step(x_t, cache):
        traces.append(None)
        return m.step(x_t, cache)

    stream(m, jnp.ones((4, 8)), m.init_cache(), jax.jit(step))
    assert len(traces) == 4


def test_non_causal_layers_refuse_to_stream(getkey):
    with pytest.raises(ValueError, match="causal=True"):
        MultiHeadSelfAttention(8, 2, getkey()).init_cache()
    with pytest.raises(ValueError, match="causal=True"):
        TransformerBlock(8, 2, 16, getkey()).init_cache(4)
    enc = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16)
    with pytest.raises(ValueError, match="causal=True"):
        enc.init_cache(4)
    causal = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    plain = MultiHeadSelfAttention(8, 2, getkey())
    with pytest.raises(ValueError, match="causal=True"):
        plain.step(jnp.ones(8), causal.init_cache())


def test_step_input_of_wrong_shape_names_shapes(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    with pytest.raises(ShapeError, match=r"x_t.shape=\(4, 8\).*\(d_model=8\)"):
        m.step(jnp.ones((4, 8)), m.init_cache())
    with pytest.raises(ShapeError, match=r"x_t.shape=\(7,\)"):
        m.step(jnp.ones(7), m.init_cache(4))
    other = MultiHeadSelfAttention(4, 2, getkey(), causal=True)
    with pytest.raises(ShapeError, match=r"cache\.keys\.shape"):
        m.step(jnp.ones(8), other.init_cache(4))
    with pytest.raises(ShapeError, match=r"cache\.keys\.shape"):
        m.step(jnp.ones(8), other.init_cache())
    enc = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16, causal=True)
    with pytest.raises(ValueError, match="tuple of 5 layer caches"):
        enc.step(jnp.ones(4), enc.init_cache(4)[:3])


def test_bad_cache_arguments(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    with pytest.raises(ValueError, match="capacity"):
        m.init_cache(0)
    with pytest.raises(ValueError, match="on_overflow"):
        m.init_cache(4, on_overflow="wrap")


@pytest.mark.parametrize("jit", [False, True])
def test_full_fixed_cache_raises(getkey, jit):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    step = eqx.filter_jit(m.step) if jit else m.step
    cache = m.init_cache(3)
    _, cache = stream(m, jnp.ones((3, 8)), cache, step)
    with pytest.raises(eqx.EquinoxRuntimeError, match="cache is full"):
        y, _ = step(jnp.ones(8), cache)
        y.block_until_ready()


def test_full_fixed_cache_reports_nan_and_flag_and_keeps_its_rows(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True)
    x = jax.random.normal(getkey(), (5, 8))
    step = eqx.filter_jit(m.step)
    cache = m.init_cache(3, on_overflow="nan")
    ys, cache = stream(m, x[:3], cache, step)
    assert not bool(cache.overflow)
    np.testing.assert_allclose(ys, m.forward(x[:3]), atol=1e-5)
    before = cache
    y, cache = step(x[3], cache)
    assert bool(jnp.all(jnp.isnan(y))) and bool(cache.overflow)
    np.testing.assert_array_equal(cache.keys, before.keys)
    np.testing.assert_array_equal(cache.values, before.values)
    y, cache = step(x[4], cache)
    assert bool(jnp.all(jnp.isnan(y))) and bool(cache.overflow) and int(cache.index) == 3


def test_positions_beyond_max_len_in_step(getkey):
    for layer in (AddPositions(2), LearnedPositions(2, 4, getkey())):
        cache = layer.init_cache()
        _, cache = stream(layer, jnp.ones((2, 4)), cache)
        with pytest.raises(eqx.EquinoxRuntimeError, match="max_len=2"):
            layer.step(jnp.ones(4), cache)[0].block_until_ready()
        cache = layer.init_cache(on_overflow="nan")
        ys, cache = stream(layer, jnp.ones((3, 4)), cache)
        assert bool(jnp.all(jnp.isfinite(ys[:2]))) and bool(jnp.all(jnp.isnan(ys[2])))
        assert bool(cache.overflow)


def test_encoder_overflow_flags_propagate_as_nan(getkey):
    enc = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16, causal=True)
    cache = enc.init_cache(2, on_overflow="nan")
    ys, cache = stream(enc, jnp.ones((3, 4)), cache, eqx.filter_jit(enc.step))
    assert bool(jnp.all(jnp.isfinite(ys[:2]))) and bool(jnp.all(jnp.isnan(ys[2])))
    assert bool(cache[2].overflow)
