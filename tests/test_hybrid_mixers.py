"""The mixers of the 2026 hybrids: LFM2's `ShortConv` and Qwen3.5's `GatedDeltaNet`, against
float64 NumPy written here from their equations (one step at a time), and their three paths
(`forward` in chunks, `prefill` in pieces, `step` by step) against each other over 2048 steps."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.nn.core import ShapeError
from dense_armor.nn.mixers.convolution import ShortConv
from dense_armor.nn.mixers.deltanet import GatedDeltaNet, unit_lower_inverse

KEY = jax.random.PRNGKey(0)


def _np(param):
    return np.asarray(param.value, np.float64)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _conv(u, kernel):
    """The causal depthwise convolution from zeros: `y_t = sum_j kernel[j] u_{t-k+1+j}`."""
    k = kernel.shape[0]
    padded = np.concatenate([np.zeros((k - 1, u.shape[1])), u])
    return np.stack([sum(kernel[j] * padded[t + j] for j in range(k)) for t in range(len(u))])


def short_conv_reference(m, x):
    b, c, v = np.split(x @ _np(m.W_in), 3, axis=1)
    return (c * _conv(b * v, _np(m.conv))) @ _np(m.W_out)


def delta_net_reference(m, x):
    """The gated delta rule one step at a time, in float64 (Yang et al. 2025, Eq. 10; the
    projections, gates and gated norm of transformers' `Qwen3_5GatedDeltaNet`)."""
    steps, hk, hv, dk, dv = len(x), m.n_key_heads, m.n_heads, m.key_dim, m.value_dim
    mixed = _silu(_conv(x @ _np(m.W_qkv), _np(m.conv)))
    q = mixed[:, : hk * dk].reshape(steps, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].reshape(steps, hk, dk)
    v = mixed[:, 2 * hk * dk :].reshape(steps, hv, dv)
    q, k = (np.repeat(t, hv // hk, axis=1) for t in (q, k))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1.0 / (1.0 + np.exp(-(x @ _np(m.W_b))))
    g = -np.exp(_np(m.A_log)) * np.log1p(np.exp(x @ _np(m.W_a) + _np(m.dt_bias)))
    s, out = np.zeros((hv, dk, dv)), np.zeros((steps, hv, dv))
    for t in range(steps):
        s = s * np.exp(g[t])[:, None, None]
        error = v[t] - np.einsum("hkv,hk->hv", s, k[t])
        s = s + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * error)
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    normed = out / np.sqrt((out * out).mean(-1, keepdims=True) + m.eps) * _np(m.norm_gain)
    z = (x @ _np(m.W_z)).reshape(steps, hv, dv)
    return (normed * _silu(z)).reshape(steps, -1) @ _np(m.W_out)


def _trained_like(m):
    """Gains and biases away from their starting values, so a wrong index shows."""
    rng = np.random.default_rng(1)
    leaves, tree = jax.tree.flatten(m)
    leaves = [
        jnp.asarray(rng.normal(0.0, 0.5, leaf.shape), leaf.dtype) + leaf
        if isinstance(leaf, jax.Array) and leaf.ndim == 1
        else leaf
        for leaf in leaves
    ]
    return jax.tree.unflatten(tree, leaves)


LAYERS = {
    "short_conv": lambda: ShortConv(16, KEY, kernel=3),
    "delta_net": lambda: _trained_like(
        GatedDeltaNet(16, 4, KEY, n_key_heads=2, key_dim=8, value_dim=6, kernel=4, chunk=16)
    ),
}
REFERENCES = {"short_conv": short_conv_reference, "delta_net": delta_net_reference}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_forward_equals_float64_numpy(name):
    m = LAYERS[name]()
    x = np.random.default_rng(2).normal(0.0, 1.0, (77, 16))  # chunks of 16 and a ragged end
    got = eqx.filter_jit(lambda m, x: m(x))(m, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, REFERENCES[name](m, x), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_forward_prefill_and_steps_agree_over_2048_steps(name):
    m = LAYERS[name]()
    x = jax.random.normal(jax.random.PRNGKey(3), (2048, 16))
    whole = eqx.filter_jit(lambda m, x: m(x))(m, x)

    @eqx.filter_jit
    def pieces(m, x):
        cache, out = m.init_cache(), []
        for start, stop in ((0, 700), (700, 701), (701, 2048)):
            y, cache = m.prefill(x[start:stop], cache)
            out.append(y)
        return jnp.concatenate(out), cache

    @eqx.filter_jit
    def steps(m, x):
        return jax.lax.scan(lambda c, x_t: m.step(x_t, c)[::-1], m.init_cache(), x)

    chunked, after_pieces = pieces(m, x)
    after_steps, stepped = steps(m, x)
    scale = float(jnp.max(jnp.abs(whole)))
    np.testing.assert_allclose(chunked, whole, atol=1e-5 * scale)
    np.testing.assert_allclose(stepped, whole, atol=1e-5 * scale)
    for a, b in zip(jax.tree.leaves(after_pieces), jax.tree.leaves(after_steps), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_masked_prefill_keeps_the_state_of_its_valid_steps(name):
    m = LAYERS[name]()
    x = jax.random.normal(jax.random.PRNGKey(4), (12, 16))
    _, valid = m.prefill(x[:7], m.init_cache())
    mask = jnp.arange(12) < 7
    _, padded = m.prefill(x, m.init_cache(), mask=mask)
    for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(valid), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_an_empty_sequence_gives_no_rows_and_leaves_the_state(name):
    m = LAYERS[name]()
    state = m.init_cache()
    _, state = m.prefill(jax.random.normal(jax.random.PRNGKey(5), (3, 16)), state)
    out, after = m.prefill(jnp.zeros((0, 16)), state)
    assert out.shape == (0, 16) and m(jnp.zeros((0, 16))).shape == (0, 16)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_mixer_arguments_are_refused():
    with pytest.raises(ValueError, match="multiple of `n_key_heads=3`"):
        GatedDeltaNet(16, 4, KEY, n_key_heads=3)
    with pytest.raises(ValueError, match="`kernel` must be a positive integer"):
        ShortConv(16, KEY, kernel=0)
    m = GatedDeltaNet(16, 4, KEY)
    with pytest.raises(
        ShapeError, match=r"expected the DeltaState of this layer's .*; received ConvState"
    ):
        m.prefill(jnp.zeros((2, 16)), ShortConv(16, KEY).init_cache())
    with pytest.raises(ShapeError, match=r"expected \(4, 4, 4\)"):
        state = m.init_cache()
        m.prefill(jnp.zeros((2, 16)), eqx.tree_at(lambda s: s.memory, state, jnp.zeros((4, 4))))


@pytest.mark.parametrize("size", [1, 2, 5, 16, 64])
def test_the_unit_lower_inverse_is_numpys(size):
    rng = np.random.default_rng(size)
    t = np.tril(rng.normal(0.0, 0.5, (3, 2, size, size)), -1) + np.eye(size)
    want = np.linalg.inv(t)
    got = np.asarray(unit_lower_inverse(jnp.asarray(t, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, want, atol=1e-6 * np.abs(want).max() * size)
