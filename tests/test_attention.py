import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dense_armor.utility.neural import (
    Gate,
    MultiHeadCrossAttention,
    MultiHeadSelfAttention,
    ShapeError,
    TransformerBlock,
    TransformerDecoderBlock,
    scaled_dot_product_attention,
)
from reference import attention, block, multi_head
from streams import stream


def with_equinox_weights(m, peer):
    """`m` with the four projections of an `eqx.nn.MultiheadAttention` (stored transposed)."""
    projections = (peer.query_proj, peer.key_proj, peer.value_proj, peer.output_proj)
    return eqx.tree_at(
        lambda m: (m.W_Q.value, m.W_K.value, m.W_V.value, m.W_O.value),
        m,
        tuple(p.weight.T for p in projections),
    )


def weights64(m):
    return [np.asarray(p.value, np.float64) for p in m.params()]


# scaled_dot_product_attention


def test_attention_one_head_by_hand():
    q = jnp.array([[1.0, 0.0]])
    k = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    v = jnp.array([[10.0], [20.0]])
    s = 1 / math.sqrt(2)
    w1 = math.exp(s) / (math.exp(s) + 1.0)
    expected = w1 * 10 + (1 - w1) * 20
    y = scaled_dot_product_attention(q, k, v)
    assert y.shape == (1, 1)
    assert float(y[0, 0]) == pytest.approx(expected, rel=1e-6)
    assert round(expected, 4) == 13.3024


def test_attention_matches_jax_reference_with_heads_and_mask(getkey):
    q = jax.random.normal(getkey(), (3, 5, 4))  # (heads, T, d_k)
    k = jax.random.normal(getkey(), (3, 7, 4))
    v = jax.random.normal(getkey(), (3, 7, 4))
    mask = jax.random.bernoulli(getkey(), 0.7, (3, 5, 7)).at[:, :, 0].set(True)
    ours = scaled_dot_product_attention(q, k, v, mask)
    # jax.nn.dot_product_attention takes (B, T, N, H) and masks (B, N, T, S).
    theirs = jax.nn.dot_product_attention(
        q.transpose(1, 0, 2)[None],
        k.transpose(1, 0, 2)[None],
        v.transpose(1, 0, 2)[None],
        mask=mask[None],
    )[0].transpose(1, 0, 2)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    np.testing.assert_allclose(
        ours,
        attention(*(np.asarray(a, np.float64) for a in (q, k, v)), np.asarray(mask)),
        atol=1e-5,
    )


def test_attention_mask_broadcasts_over_heads(getkey):
    q, k, v = (jax.random.normal(getkey(), (2, 4, 3)) for _ in range(3))
    causal = jnp.tril(jnp.ones((4, 4), bool))
    y = scaled_dot_product_attention(q, k, v, causal)
    np.testing.assert_allclose(
        y,
        attention(*(np.asarray(a, np.float64) for a in (q, k, v)), np.asarray(causal)),
        atol=1e-5,
    )


def softmax_attention_loss(q, k, v, mask, probe):
    """The attention written out with jax.nn.softmax and differentiated by JAX, in float64
    (rows that see nothing give zeros): the reference for the written-out derivative."""
    scores = jnp.einsum("...td,...sd->...ts", q, k) / np.sqrt(q.shape[-1])
    if mask is None:
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        seen = mask.any(axis=-1, keepdims=True)
        weights = jax.nn.softmax(jnp.where(mask & seen, scores, jnp.where(seen, -jnp.inf, 0.0)))
        weights = jnp.where(seen, weights, 0.0)
    return jnp.sum(jnp.einsum("...ts,...sd->...td", weights, v) * probe)


GRADIENT_CASES = [
    # (q shape, k shape, mask): leading axes broadcast; "rows" hides every key of row 1
    ((5, 4), (7, 4), None),
    ((2, 5, 4), (2, 7, 4), "causal"),
    ((3, 2, 6, 8), (1, 2, 6, 8), None),
    ((3, 2, 6, 8), (3, 1, 9, 8), "random"),
    ((2, 5, 4), (2, 5, 4), "rows"),
]


@pytest.mark.parametrize("q_shape, k_shape, kind", GRADIENT_CASES)
def test_the_gradient_matches_the_softmax_differentiated_in_float64(getkey, q_shape, k_shape, kind):
    q = jax.random.normal(getkey(), q_shape)
    k = jax.random.normal(getkey(), k_shape)
    v = jax.random.normal(getkey(), (*k_shape[:-1], 3))
    t, s = q_shape[-2], k_shape[-2]
    mask = {
        None: None,
        "causal": jnp.tril(jnp.ones((t, s), bool)),
        "random": jax.random.bernoulli(getkey(), 0.6, (t, s)),
        "rows": jnp.ones((t, s), bool).at[1].set(False),
    }[kind]
    out = scaled_dot_product_attention(q, k, v, mask)
    probe = jax.random.normal(getkey(), out.shape)
    grads = jax.grad(
        lambda q, k, v: jnp.sum(scaled_dot_product_attention(q, k, v, mask) * probe),
        argnums=(0, 1, 2),
    )(q, k, v)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, probe)]
        expected = jax.grad(softmax_attention_loss, argnums=(0, 1, 2))(*wide[:3], mask, wide[3])
        expected = [np.asarray(e) for e in expected]
    for got, want in zip(grads, expected, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_the_gradient_matches_finite_differences(getkey):
    q, k, v = (jax.random.normal(getkey(), (2, 6, 4)) for _ in range(3))
    mask = jnp.tril(jnp.ones((6, 6), bool))
    for m in (None, mask):
        jax.test_util.check_grads(
            lambda q, k, v, m=m: jnp.sum(scaled_dot_product_attention(q, k, v, m) ** 2),
            (q, k, v),
            order=1,
            modes=["rev"],
            atol=2e-2,
            rtol=2e-2,
        )


def test_fully_masked_rows_give_zeros_and_finite_gradients(getkey):
    q, k, v = (jax.random.normal(getkey(), (4, 3)) for _ in range(3))
    mask = jnp.ones((4, 4), bool).at[1].set(False)

    def loss(q, k, v):
        return (scaled_dot_product_attention(q, k, v, mask) ** 2).sum()

    y = scaled_dot_product_attention(q, k, v, mask)
    assert bool(jnp.all(y[1] == 0.0))
    assert bool(jnp.all(jnp.isfinite(y)))
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert bool(jnp.all(jnp.isfinite(g)))
    assert bool(jnp.all(grads[0][1] == 0.0))
    none_visible = scaled_dot_product_attention(q, k, v, jnp.zeros((4, 4), bool))
    assert bool(jnp.all(none_visible == 0.0))


def test_attention_softmax_in_float32_for_bfloat16(getkey):
    q, k, v = (jax.random.normal(getkey(), (6, 8)) for _ in range(3))
    y16 = scaled_dot_product_attention(
        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    )
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(y16, np.float32), scaled_dot_product_attention(q, k, v), atol=3e-2
    )


def test_attention_rejects_bad_shapes(getkey):
    q = jax.random.normal(getkey(), (4, 3))
    with pytest.raises(
        ShapeError, match=r"`k`: expected Float\['\*#batch S d_k'\], received shape \(5, 2\)"
    ):
        scaled_dot_product_attention(q, jnp.ones((5, 2)), jnp.ones((5, 2)))
    with pytest.raises(ShapeError, match=r"mask.shape=\(3, 4\)"):
        scaled_dot_product_attention(q, q, q, jnp.ones((3, 4), bool))


# MultiHeadSelfAttention


def test_self_attention_shapes_and_params(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey())
    assert m.forward(jnp.ones((4, 8))).shape == (4, 8)
    assert m.params() == [m.W_Q, m.W_K, m.W_V, m.W_O]
    assert all(p.value.shape == (8, 8) for p in m.params())
    assert m(jnp.ones((4, 8))).shape == (4, 8)


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_matches_numpy_reference(getkey, causal):
    m = MultiHeadSelfAttention(12, 3, getkey(), causal=causal)
    x = jax.random.normal(getkey(), (6, 12))
    expected = multi_head(np.asarray(x, np.float64), *weights64(m), 3, causal=causal)
    np.testing.assert_allclose(m.forward(x), expected, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_matches_equinox_with_copied_weights(getkey, causal):
    peer = eqx.nn.MultiheadAttention(4, 16, key=getkey())
    m = MultiHeadSelfAttention(16, 4, getkey(), causal=causal)
    m = with_equinox_weights(m, peer)
    x = jax.random.normal(getkey(), (7, 16))
    mask = jnp.tril(jnp.ones((7, 7), bool)) if causal else None
    np.testing.assert_allclose(m.forward(x), peer(x, x, x, mask=mask), atol=1e-5)


def test_self_attention_causal_mask_is_minus_infinity(getkey):
    """A masked key has weight exactly 0, however large its score would be."""
    m = MultiHeadSelfAttention(4, 1, getkey(), causal=True)
    x = jax.random.normal(getkey(), (3, 4))
    huge_future = x.at[2].set(1e4)
    np.testing.assert_array_equal(m.forward(x)[:2], m.forward(huge_future)[:2])


# Property tests draw lengths from a few buckets and call a jitted forward, so their examples
# share a handful of compilations instead of compiling every primitive at every drawn length.
LENGTHS = st.sampled_from([2, 3, 6, 9])
jitted_forward = jax.jit(lambda layer, x: layer.forward(x))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), length=LENGTHS)
def test_self_attention_is_permutation_equivariant(seed, length):
    key = jax.random.PRNGKey(seed)
    m = MultiHeadSelfAttention(8, 2, key)
    x = jax.random.normal(jax.random.fold_in(key, 1), (length, 8))
    perm = np.random.default_rng(seed).permutation(length)
    np.testing.assert_allclose(jitted_forward(m, x[perm]), jitted_forward(m, x)[perm], atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), length=LENGTHS, data=st.data())
def test_causal_output_ignores_later_inputs(seed, length, data):
    t = data.draw(st.integers(0, length - 2))
    key = jax.random.PRNGKey(seed)
    b = TransformerBlock(8, 2, 16, key, causal=True)
    x = jax.random.normal(jax.random.fold_in(key, 1), (length, 8))
    changed = x.at[t + 1 :].set(jax.random.normal(jax.random.fold_in(key, 2), (length - t - 1, 8)))
    np.testing.assert_allclose(
        jitted_forward(b, changed)[: t + 1], jitted_forward(b, x)[: t + 1], atol=1e-6
    )


@pytest.mark.parametrize("d_model, n_heads", [(10, 3), (8, 3), (2, 4)])
def test_d_model_not_divisible_by_n_heads_raises(getkey, d_model, n_heads):
    with pytest.raises(ValueError, match=f"d_model={d_model}.*n_heads={n_heads}"):
        MultiHeadSelfAttention(d_model, n_heads, getkey())
    with pytest.raises(ValueError, match="divisible"):
        TransformerBlock(d_model, n_heads, 16, getkey())


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_sizes_raise(getkey, bad):
    with pytest.raises(ValueError, match="n_heads"):
        MultiHeadSelfAttention(8, bad, getkey())
    with pytest.raises(ValueError, match="d_ff"):
        TransformerBlock(8, 2, bad, getkey())


def test_wrong_width_or_rank_names_shapes(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey())
    with pytest.raises(ShapeError, match=r"x.shape=\(4, 7\).*\(T, d_model=8\)"):
        m.forward(jnp.ones((4, 7)))
    with pytest.raises(ShapeError, match=r"x.shape=\(2, 4, 8\).*jax.vmap"):
        m.forward(jnp.ones((2, 4, 8)))
    with pytest.raises(ShapeError, match=r"x.shape=\(8,\)"):
        m.forward(jnp.ones((8,)))


def test_shape_errors_are_raised_under_jit(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey())
    with pytest.raises(ShapeError, match="d_model=8"):
        jax.jit(lambda m, x: m(x))(m, jnp.ones((4, 6)))


# TransformerBlock


def test_block_matches_numpy_reference(getkey):
    b = TransformerBlock(8, 2, 16, getkey())
    x = jax.random.normal(getkey(), (5, 8))
    np.testing.assert_allclose(b.forward(x), block(np.asarray(x, np.float64), b), atol=1e-5)


def test_block_causal_matches_numpy_reference(getkey):
    b = TransformerBlock(8, 4, 12, getkey(), causal=True)
    x = jax.random.normal(getkey(), (6, 8))
    np.testing.assert_allclose(b.forward(x), block(np.asarray(x, np.float64), b), atol=1e-5)


def test_block_params_order(getkey):
    b = TransformerBlock(8, 2, 16, getkey())
    p = b.params()
    assert len(p) == 12
    assert p[:4] == b.attention.params()
    assert p[4:6] == [b.norm1.gain, b.norm1.bias]
    ff = b.feed_forward
    assert p[6:10] == [ff.hidden.W, ff.hidden.b, ff.out.W, ff.out.b]
    assert p[10:] == [b.norm2.gain, b.norm2.bias]


def test_block_output_is_layer_normalised(getkey):
    b = TransformerBlock(8, 2, 16, getkey())
    y = b.forward(jax.random.normal(getkey(), (4, 8)))
    np.testing.assert_allclose(y.mean(axis=-1), 0.0, atol=1e-6)
    np.testing.assert_allclose(y.std(axis=-1), 1.0, atol=1e-4)


def test_block_dropout_acts_on_sublayer_outputs_before_the_residual(getkey):
    """With rate 1 every sub-layer output is dropped: z = LN(LN(x)), by the page's equations."""
    b = TransformerBlock(8, 2, 16, getkey(), dropout=1.0)
    x = jax.random.normal(getkey(), (4, 8))
    z = b.forward(x, key=getkey())
    np.testing.assert_allclose(z, b.norm2(b.norm1(x)), atol=1e-6)


def test_block_dropout_only_with_a_key(getkey):
    x = jax.random.normal(getkey(), (6, 8))
    key = getkey()
    b = TransformerBlock(8, 2, 16, key, dropout=0.5)
    plain = TransformerBlock(8, 2, 16, key)
    np.testing.assert_array_equal(b.forward(x), plain.forward(x))
    y1, y2 = b.forward(x, key=getkey()), b.forward(x, key=getkey())
    assert not np.allclose(y1, y2)
    np.testing.assert_array_equal(b.forward(x, key=key), b.forward(x, key=key))
    np.testing.assert_array_equal(plain.forward(x, key=key), plain.forward(x))


def test_block_rejects_bad_dropout(getkey):
    with pytest.raises(ValueError, match="rate"):
        TransformerBlock(8, 2, 16, getkey(), dropout=1.5)


# MultiHeadCrossAttention


def test_cross_attention_one_head_by_hand(getkey):
    """Identity projections, one head: the page's one-head example, now from a context."""
    m = MultiHeadCrossAttention(2, 1, getkey(), d_context=2)
    eye = jnp.eye(2)
    m = eqx.tree_at(lambda m: (m.W_Q.value, m.W_K.value, m.W_V.value, m.W_O.value), m, (eye,) * 4)
    x = jnp.array([[1.0, 0.0]])
    context = jnp.array([[1.0, 0.0], [0.0, 1.0]]) * jnp.array([[1.0], [1.0]])
    s = 1 / math.sqrt(2)
    w1 = math.exp(s) / (math.exp(s) + 1)
    np.testing.assert_allclose(m(x, context)[0], [w1, 1 - w1], rtol=1e-6)
    only_second = m(x, context, context_mask=jnp.array([False, True]))
    np.testing.assert_allclose(only_second[0], [0.0, 1.0], atol=1e-7)


def test_cross_attention_matches_equinox_with_copied_weights(getkey):
    peer = eqx.nn.MultiheadAttention(2, 8, key_size=5, value_size=5, key=getkey())
    m = MultiHeadCrossAttention(8, 2, getkey(), d_context=5)
    m = with_equinox_weights(m, peer)
    x = jax.random.normal(getkey(), (4, 8))
    context = jax.random.normal(getkey(), (6, 5))
    np.testing.assert_allclose(m(x, context), peer(x, context, context), atol=1e-5)
    mask = jnp.array([True, True, False, True, False, True])
    np.testing.assert_allclose(
        m(x, context, context_mask=mask),
        peer(x, context, context, mask=jnp.broadcast_to(mask, (4, 6))),
        atol=1e-5,
    )


def test_cross_attention_padding_equals_the_unpadded_context_and_never_nans(getkey):
    m = MultiHeadCrossAttention(8, 2, getkey(), d_context=3)
    x = jax.random.normal(getkey(), (4, 8))
    context = jax.random.normal(getkey(), (5, 3))
    padded = jnp.concatenate([context, jnp.full((3, 3), 1e3)])
    mask = jnp.arange(8) < 5
    np.testing.assert_allclose(m(x, padded, context_mask=mask), m(x, context), atol=1e-6)
    nothing = jnp.zeros(8, bool)
    np.testing.assert_array_equal(m(x, padded, context_mask=nothing), 0.0)
    grads = jax.grad(lambda m: m(x, padded, context_mask=nothing).sum())(m)
    assert all(bool(jnp.all(jnp.isfinite(p.value))) for p in grads.params())


def test_cross_attention_step_uses_the_projected_context(getkey):
    m = MultiHeadCrossAttention(8, 4, getkey())
    x = jax.random.normal(getkey(), (5, 8))
    context = jax.random.normal(getkey(), (7, 8))
    cache = m.init_cache(context)
    np.testing.assert_allclose(cache.keys, context @ m.W_K.value, atol=1e-6)
    ys, _ = stream(m, x, cache)
    np.testing.assert_allclose(ys, m(x, context), atol=1e-6)


def test_cross_attention_errors(getkey):
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadCrossAttention(10, 3, getkey())
    with pytest.raises(ValueError, match="d_context"):
        MultiHeadCrossAttention(8, 2, getkey(), d_context=0)
    m = MultiHeadCrossAttention(8, 2, getkey(), d_context=5)
    with pytest.raises(ShapeError, match=r"context.shape=\(6, 8\).*d_context=5"):
        m(jnp.ones((4, 8)), jnp.ones((6, 8)))
    with pytest.raises(ShapeError, match=r"x.shape=\(2, 4, 8\).*jax.vmap"):
        m(jnp.ones((2, 4, 8)), jnp.ones((6, 5)))
    with pytest.raises(ShapeError, match="`context_mask`"):
        m(jnp.ones((4, 8)), jnp.ones((6, 5)), context_mask=jnp.ones(5, bool))
    assert len(m.params()) == 4 and m.W_K.value.shape == (5, 8)


# Gate


def test_gate_by_hand(getkey):
    gate = Gate(2, getkey())
    gate = eqx.tree_at(
        lambda g: (g.U.value, g.W.value, g.b.value),
        gate,
        (jnp.zeros((2, 2)), jnp.zeros((2, 2)), jnp.array([0.0, math.log(3.0)])),
    )
    # g = sigmoid(-b) = [1/2, 1/4]
    z = gate(jnp.array([4.0, 4.0]), jnp.array([0.0, 8.0]))
    np.testing.assert_allclose(z, [2.0, 0.75 * 4 + 0.25 * 8], rtol=1e-6)
    assert len(gate.params()) == 3


def test_gate_extremes_reduce_to_each_input_and_gradients_reach_both(getkey):
    gate = Gate(4, getkey())
    x, y = jax.random.normal(getkey(), (3, 4)), jax.random.normal(getkey(), (3, 4))
    closed = eqx.tree_at(lambda g: g.b.value, gate, jnp.full((4,), 1e4))
    opened = eqx.tree_at(lambda g: g.b.value, gate, jnp.full((4,), -1e4))
    np.testing.assert_array_equal(closed(x, y), x)
    np.testing.assert_array_equal(opened(x, y), y)
    gx, gy = jax.grad(lambda x, y: gate(x, y).sum(), argnums=(0, 1))(x, y)
    assert float(jnp.abs(gx).min()) > 0 and float(jnp.abs(gy).min()) > 0
    assert 0.05 < float(jax.nn.sigmoid(-gate.b.value[0])) < 0.2  # starts near the identity


def test_gated_block(getkey):
    key = getkey()
    plain = TransformerBlock(8, 2, 16, key, causal=True)
    gated = TransformerBlock(8, 2, 16, key, causal=True, gate=True)
    assert len(gated.params()) == 18 and gated.params()[:12] == plain.params()
    x = jax.random.normal(getkey(), (6, 8))
    # A gate fully open to the sub-layer output is the residual addition without the residual.
    opened = eqx.tree_at(
        lambda b: (b.gates[0].b.value, b.gates[1].b.value), gated, (jnp.full(8, -1e4),) * 2
    )
    y = plain.norm1(plain.attention(x))
    np.testing.assert_allclose(opened(x), plain.norm2(plain.feed_forward(y)), atol=1e-5)
    ys, _ = stream(gated, x, gated.init_cache(8))
    np.testing.assert_allclose(ys, gated(x), atol=1e-5)


# TransformerDecoderBlock


def test_decoder_block_matches_its_equations(getkey):
    d = TransformerDecoderBlock(8, 2, 16, getkey(), d_context=5)
    x, context = jax.random.normal(getkey(), (4, 8)), jax.random.normal(getkey(), (3, 5))
    y = d.norm1(x + d.self_attention(x))
    u = d.norm2(y + d.cross_attention(y, context))
    np.testing.assert_allclose(d(x, context), d.norm3(u + d.feed_forward(u)), atol=1e-6)
    assert d.self_attention.causal and len(d.params()) == 18
    assert len(TransformerDecoderBlock(8, 2, 16, getkey(), gate=True).params()) == 27


@pytest.mark.parametrize("capacity", [None, 9])
def test_decoder_block_step_equals_forward_on_every_prefix(getkey, capacity):
    d = TransformerDecoderBlock(8, 2, 16, getkey(), d_context=3, gate=True)
    x, context = jax.random.normal(getkey(), (9, 8)), jax.random.normal(getkey(), (4, 3))
    mask = jnp.array([True, False, True, True])
    cache = d.init_cache(context, capacity, context_mask=mask, on_overflow="nan")
    step = eqx.filter_jit(d.step)
    full = d(x, context, context_mask=mask)
    for t in range(9):
        y_t, cache = step(x[t], cache)
        np.testing.assert_allclose(y_t, full[t], atol=1e-5)
