import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.utility.neural import (
    Dense,
    Dropout,
    FeedForward,
    LayerNorm,
    MeanOverTime,
    Param,
    ReLU,
    ShapeError,
)
from reference import layer_norm


def test_dense_by_hand(getkey):
    d = Dense(2, 3, getkey())
    d = eqx.tree_at(
        lambda d: (d.W.value, d.b.value),
        d,
        (jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), jnp.array([0.5, -0.5, 1.0])),
    )
    y = d.forward(jnp.array([[1.0, 1.0], [2.0, 0.0]]))
    np.testing.assert_array_equal(y, [[5.5, 6.5, 10.0], [2.5, 3.5, 7.0]])
    np.testing.assert_array_equal(d.forward(jnp.array([1.0, 1.0])), [5.5, 6.5, 10.0])
    assert d.params() == [d.W, d.b]


def test_dense_init_bounds(getkey):
    d = Dense(16, 32, getkey())
    assert d.W.value.shape == (16, 32) and d.b.value.shape == (32,)
    assert float(jnp.abs(d.W.value).max()) <= 0.25


def test_dense_rejects_wrong_width(getkey):
    with pytest.raises(ShapeError, match=r"x.shape=\(4, 3\).*n_in=2"):
        Dense(2, 3, getkey()).forward(jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="n_out"):
        Dense(2, 0, getkey())


def test_layer_norm_matches_reference(getkey):
    ln = LayerNorm(6)
    ln = eqx.tree_at(
        lambda m: (m.gain.value, m.bias.value),
        ln,
        (jax.random.normal(getkey(), (6,)), jax.random.normal(getkey(), (6,))),
    )
    x = 3.0 * jax.random.normal(getkey(), (5, 6)) + 2.0
    expected = layer_norm(
        np.asarray(x, np.float64),
        np.asarray(ln.gain.value, np.float64),
        np.asarray(ln.bias.value, np.float64),
    )
    np.testing.assert_allclose(ln.forward(x), expected, atol=1e-5)
    assert len(ln.params()) == 2


def test_layer_norm_matches_equinox_with_copied_weights(getkey):
    ln = LayerNorm(6)
    gain, bias = jax.random.normal(getkey(), (6,)), jax.random.normal(getkey(), (6,))
    ln = eqx.tree_at(lambda m: (m.gain.value, m.bias.value), ln, (gain, bias))
    peer = eqx.tree_at(lambda m: (m.weight, m.bias), eqx.nn.LayerNorm(6), (gain, bias))
    x = 3.0 * jax.random.normal(getkey(), (5, 6)) + 2.0
    np.testing.assert_allclose(ln.forward(x), jax.vmap(peer)(x), atol=1e-6, rtol=0)


def test_layer_norm_statistics_in_float32(getkey):
    x = (100.0 + jax.random.normal(getkey(), (4, 64))).astype(jnp.bfloat16)
    y = LayerNorm(64).forward(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32).mean(-1), 0.0, atol=2e-2)


def test_relu():
    np.testing.assert_array_equal(ReLU()(jnp.array([-1.0, 0.0, 2.0])), [0.0, 0.0, 2.0])


def test_relu_gives_what_jax_nn_relu_gives_nan_infinities_and_gradient_included():
    x = jnp.array([-np.inf, -1.0, -0.0, 0.0, 2.0, np.inf, np.nan])
    np.testing.assert_array_equal(ReLU()(x), jax.nn.relu(x))
    grad = jax.vmap(jax.grad(lambda x: ReLU()(x[None])[0]))(x)
    np.testing.assert_array_equal(grad, jax.vmap(jax.grad(jax.nn.relu))(x))


def test_dropout_is_identity_without_key_and_scales_with_key(getkey):
    x = jnp.ones((1000,))
    drop = Dropout(0.25)
    np.testing.assert_array_equal(drop(x), x)
    y = drop(x, key=getkey())
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert 0.65 < float(kept.mean()) < 0.85
    np.testing.assert_array_equal(Dropout(1.0)(x, key=getkey()), 0.0)
    with pytest.raises(ValueError, match="rate"):
        Dropout(-0.1)


def test_feed_forward_by_hand(getkey):
    ff = FeedForward(2, 3, getkey())
    ff = eqx.tree_at(
        lambda f: (f.hidden.W.value, f.hidden.b.value, f.out.W.value, f.out.b.value),
        ff,
        (
            jnp.array([[1.0, -1.0, 0.0], [0.0, 1.0, 2.0]]),
            jnp.array([0.0, 0.0, -1.0]),
            jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
            jnp.array([0.5, 0.5]),
        ),
    )
    # x = [1, 2]: hidden = max(0, [1, 1, 3]) = [1, 1, 3]; out = [1 + 3, 1 + 3] + 0.5
    np.testing.assert_array_equal(ff(jnp.array([1.0, 2.0])), [4.5, 4.5])
    # x = [2, -1]: hidden = max(0, [2, -3, -3]) = [2, 0, 0]; out = [2, 0] + 0.5
    np.testing.assert_array_equal(ff(jnp.array([2.0, -1.0])), [2.5, 0.5])
    assert len(ff.params()) == 4


def test_mean_over_time(getkey):
    x = jax.random.normal(getkey(), (5, 3))
    np.testing.assert_allclose(MeanOverTime()(x), np.asarray(x).mean(0), atol=1e-6)
    assert MeanOverTime().params() == []
    with pytest.raises(ShapeError, match="empty"):
        MeanOverTime()(jnp.ones((0, 3)))


def test_mean_over_time_streams_a_running_mean(getkey):
    x = jax.random.normal(getkey(), (6, 3))
    m = MeanOverTime(3)
    cache = m.init_cache()
    for t in range(6):
        y, cache = m.step(x[t], cache)
        np.testing.assert_allclose(y, np.asarray(x[: t + 1]).mean(0), atol=1e-6)
    with pytest.raises(ValueError, match=r"MeanOverTime\(features\)"):
        MeanOverTime().init_cache()


def test_param_is_a_pytree_leaf_holder():
    p = Param(jnp.ones(3))
    assert jax.tree_util.tree_leaves(p)[0].shape == (3,)
