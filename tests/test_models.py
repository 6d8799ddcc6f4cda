import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dense_armor.utility.neural import (
    AddPositions,
    Dense,
    LearnedPositions,
    MeanOverTime,
    Sequential,
    ShapeError,
    TransformerBlock,
    transformer_decoder,
    transformer_encoder,
)
from reference import sinusoid


def test_encoder_structure(getkey):
    m = transformer_encoder(4, 8, 2, 16, 2, 3, getkey(), 16)
    kinds = [type(layer) for layer in m.layers]
    assert kinds == [Dense, AddPositions, TransformerBlock, TransformerBlock, MeanOverTime, Dense]
    assert m.forward(jnp.ones((5, 4))).shape == (3,)
    assert len(m.params()) == 2 + 2 * 12 + 2
    learned = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16, positions="learned")
    assert isinstance(learned.layers[1], LearnedPositions)
    assert len(learned.params()) == 2 + 1 + 12 + 2


def test_encoder_is_its_composition_by_hand(getkey):
    m = transformer_encoder(3, 8, 2, 16, 1, 2, getkey(), 10)
    x = jax.random.normal(getkey(), (6, 3))
    dense_in, _, blk, _, dense_out = m.layers
    h = dense_in(x) + jnp.asarray(sinusoid(6, 8), jnp.float32)
    expected = dense_out(blk(h).mean(axis=0))
    np.testing.assert_allclose(m(x), expected, atol=1e-5)


def test_encoder_bad_arguments(getkey):
    with pytest.raises(ValueError, match="divisible"):
        transformer_encoder(4, 10, 3, 16, 1, 3, getkey(), 16)
    with pytest.raises(ValueError, match="depth"):
        transformer_encoder(4, 8, 2, 16, 0, 3, getkey(), 16)
    with pytest.raises(ValueError, match="positions"):
        transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16, positions="rotary")
    m = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16)
    with pytest.raises(ShapeError, match=r"x.shape=\(5, 5\).*n_in=4"):
        m(jnp.ones((5, 5)))
    with pytest.raises(ShapeError, match="max_len=16"):
        m(jnp.ones((17, 4)))
    with pytest.raises(ValueError, match="at least one layer"):
        Sequential()


def test_encoder_under_jit_filter_jit_and_vmap(getkey):
    m = transformer_encoder(4, 8, 2, 16, 2, 3, getkey(), 16, dropout=0.1)
    xs = jax.random.normal(getkey(), (3, 5, 4))
    eager = np.stack([m(x) for x in xs])
    batched = jax.vmap(m)(xs)
    np.testing.assert_allclose(batched, eager, atol=1e-5)
    np.testing.assert_allclose(jax.jit(lambda m, x: jax.vmap(m)(x))(m, xs), eager, atol=1e-5)
    np.testing.assert_allclose(eqx.filter_jit(eqx.filter_vmap(m))(xs), eager, atol=1e-5)


def test_grad_reaches_every_param(getkey):
    m = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16, positions="learned")
    x = jax.random.normal(getkey(), (5, 4))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(m)
    for g in grads.params():
        assert bool(jnp.all(jnp.isfinite(g.value)))
    assert all(float(jnp.abs(g.value).sum()) > 0 for g in grads.params())


def test_tree_at_replaces_a_param(getkey):
    m = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16)
    out = m.layers[-1]
    zeroed = eqx.tree_at(lambda m: m.layers[-1].W.value, m, jnp.zeros_like(out.W.value))
    np.testing.assert_allclose(zeroed(jnp.ones((5, 4))), out.b.value, atol=1e-7)


@pytest.mark.optax
def test_a_few_optax_steps_reduce_the_loss(getkey):
    m = transformer_encoder(4, 16, 2, 32, 1, 2, getkey(), 16, dropout=0.1)
    xs = jax.random.normal(getkey(), (16, 6, 4))
    labels = (xs[:, :, 0].mean(axis=1) > 0).astype(jnp.int32)
    optimiser = optax.adam(3e-3)
    state = optimiser.init(eqx.filter(m, eqx.is_inexact_array))

    def loss_fn(m, key):
        logits = jax.vmap(lambda x, k: m(x, key=k))(xs, jax.random.split(key, xs.shape[0]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @eqx.filter_jit
    def train_step(m, state, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m, key)
        updates, state = optimiser.update(grads, state, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), state, loss

    first = None
    for _ in range(40):
        m, state, loss = train_step(m, state, getkey())
        first = float(loss) if first is None else first
    final = float(loss_fn(m, getkey()))
    assert final < 0.5 * first


def test_transformer_decoder(getkey):
    m = transformer_decoder(3, 8, 2, 16, 2, 4, getkey(), 10, d_context=5)
    assert len(m.params()) == 2 + 2 * 18 + 2
    x, context = jax.random.normal(getkey(), (6, 3)), jax.random.normal(getkey(), (7, 5))
    y = m(x, context)
    assert y.shape == (6, 4)
    h = m.positions(m.embed(x))
    for block in m.blocks:
        h = block(h, context)
    np.testing.assert_allclose(y, m.head(h), atol=1e-6)
    cache = m.init_cache(context, 10, on_overflow="nan")
    step = eqx.filter_jit(m.step)
    for t in range(6):
        y_t, cache = step(x[t], cache)
        np.testing.assert_allclose(y_t, y[t], atol=1e-5)
    with pytest.raises(ValueError, match="tuple of 3 caches"):
        m.step(x[0], cache[:2])
    with pytest.raises(ShapeError, match="max_len=10"):
        m(jnp.ones((11, 3)), context)
    assert len(transformer_decoder(3, 8, 2, 16, 1, 4, getkey(), 10, gate=True).params()) == 31


def test_numpy_inputs_are_accepted(getkey):
    m = transformer_encoder(4, 8, 2, 16, 1, 3, getkey(), 16, causal=True)
    x = np.ones((5, 4), np.float32)
    np.testing.assert_array_equal(m(x), m(jnp.asarray(x)))
    y_t, _ = m.step(x[0], m.init_cache(4))
    assert y_t.shape == (3,)
