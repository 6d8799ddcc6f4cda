"""The memory-efficient (blocked, online-softmax) attention path: exact against independent
references, its own gradient, its masks, the layers' choice of path, and its memory."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dense_armor.utility.neural import (
    BLOCKED_MIN_LENGTH,
    MultiHeadCrossAttention,
    MultiHeadSelfAttention,
    ShapeError,
    TransformerBlock,
    blocked_attention,
    transformer_decoder,
    transformer_encoder,
)
from dense_armor.utility.neural.blocked import use_blocked
from reference import attention


def structured_mask(t, s, causal=False, window=None, key_mask=None):
    """The boolean `(T, S)` mask that `causal`, `window` and `key_mask` describe, built here."""
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    mask = np.ones((t, s), bool)
    if causal:
        mask &= cols <= rows
    if window is not None:
        mask &= cols > rows - window
    if key_mask is not None:
        mask &= np.asarray(key_mask)[..., None, :]
    return mask


def reference_loss(q, k, v, mask, probe):
    """A plain-jnp softmax attention (masked rows give zeros), for reference gradients."""
    scores = jnp.einsum("...td,...sd->...ts", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(jnp.where(mask, scores, -1e30), axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(scores - peak), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    weights = e / jnp.where(total > 0, total, 1.0)
    return jnp.sum(jnp.einsum("...ts,...sd->...td", weights, v) * probe)


CASES = [
    # (T, S, causal, window, with key mask, block sizes)
    (37, 37, False, None, False, (8, 16)),
    (37, 37, True, None, False, (8, 16)),
    (37, 37, True, 5, False, (16, 8)),
    (37, 37, True, 11, True, (8, 8)),
    (21, 50, False, None, True, (16, 16)),
    (64, 64, True, None, True, (16, 16)),
    (5, 5, False, None, False, (512, 512)),
]


@pytest.mark.parametrize("t, s, causal, window, with_mask, block", CASES)
def test_blocked_matches_the_reference_and_its_gradient(
    getkey, t, s, causal, window, with_mask, block
):
    q = jax.random.normal(getkey(), (3, t, 8))
    k = jax.random.normal(getkey(), (3, s, 8))
    v = jax.random.normal(getkey(), (3, s, 6))
    key_mask = (jnp.arange(s) % 7 != 3) if with_mask else None
    mask = structured_mask(t, s, causal, window, key_mask)

    out = blocked_attention(
        q, k, v, causal=causal, window=window, key_mask=key_mask, block_size=block
    )
    expected = attention(*(np.asarray(a, np.float64) for a in (q, k, v)), mask)
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)

    probe = jax.random.normal(getkey(), out.shape)

    def loss(q, k, v):
        o = blocked_attention(
            q, k, v, causal=causal, window=window, key_mask=key_mask, block_size=block
        )
        return jnp.sum(o * probe)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    expected_grads = jax.grad(reference_loss, argnums=(0, 1, 2))(q, k, v, mask, probe)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_blocked_gradient_matches_finite_differences(getkey):
    q, k, v = (jax.random.normal(getkey(), (2, 11, 4), jnp.float32) for _ in range(3))

    def f(q, k, v):
        return jnp.sum(blocked_attention(q, k, v, causal=True, block_size=(4, 4)) ** 2)

    jax.test_util.check_grads(f, (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


def test_blocked_fully_hidden_rows_give_zeros_and_finite_gradients(getkey):
    q, k, v = (jax.random.normal(getkey(), (2, 9, 4)) for _ in range(3))
    key_mask = jnp.array([[True] * 9, [False] * 9])  # the second head sees nothing
    out = blocked_attention(q, k, v, key_mask=key_mask, block_size=(4, 4))
    np.testing.assert_array_equal(out[1], np.zeros((9, 4)))
    grads = jax.grad(
        lambda q, k, v: blocked_attention(q, k, v, key_mask=key_mask, block_size=(4, 4)).sum(),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g in grads:
        assert bool(jnp.isfinite(g).all())
        np.testing.assert_array_equal(g[1], np.zeros_like(g[1]))


def test_blocked_broadcasts_leading_axes_and_keeps_the_dtype(getkey):
    q = jax.random.normal(getkey(), (2, 3, 10, 4))
    k = jax.random.normal(getkey(), (3, 10, 4))  # shared by the leading axis of q
    v = jax.random.normal(getkey(), (3, 10, 4))
    out = blocked_attention(q, k, v, block_size=(4, 4))
    expected = attention(np.asarray(q, np.float64), np.asarray(k), np.asarray(v))
    np.testing.assert_allclose(out, expected, atol=2e-6)
    low = blocked_attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32), expected, atol=5e-2)


def test_blocked_errors(getkey):
    q = jax.random.normal(getkey(), (6, 4))
    k = jax.random.normal(getkey(), (5, 4))
    with pytest.raises(ShapeError, match="T=6, S=5"):
        blocked_attention(q, k, k, causal=True)
    with pytest.raises(ValueError, match="needs `causal=True`"):
        blocked_attention(q, k, k, window=2)
    with pytest.raises(ShapeError, match="share `d_k`"):
        blocked_attention(q, k[:, :3], k)
    with pytest.raises(ShapeError, match="do not broadcast"):
        blocked_attention(q, k, k, key_mask=jnp.ones(4, bool))
    with pytest.raises(ValueError, match="block_q"):
        blocked_attention(q, k, k, block_size=(0, 4))


# Sizes from buckets that still mix whole and partial blocks, windows shorter and longer than a
# block: every drawn combination is a compilation of its own.
@settings(max_examples=8, deadline=None)
@given(
    t=st.sampled_from([1, 7, 16, 40]),
    block_q=st.sampled_from([1, 3, 8, 16]),
    block_k=st.sampled_from([1, 3, 8, 16]),
    window=st.one_of(st.none(), st.sampled_from([1, 2, 5, 40])),
    seed=st.integers(0, 2**16),
)
def test_blocked_causal_any_blocks_any_window(t, block_q, block_k, window, seed):
    q, k, v = jax.random.normal(jax.random.PRNGKey(seed), (3, 2, t, 4))
    out = blocked_attention(q, k, v, causal=True, window=window, block_size=(block_q, block_k))
    mask = structured_mask(t, t, True, window)
    expected = attention(*(np.asarray(a, np.float64) for a in (q, k, v)), mask)
    np.testing.assert_allclose(out, expected, atol=3e-6, rtol=1e-5)


# the layers' choice of path


def test_use_blocked_follows_the_setting_then_the_length():
    assert use_blocked(None, BLOCKED_MIN_LENGTH, BLOCKED_MIN_LENGTH)
    assert not use_blocked(None, BLOCKED_MIN_LENGTH - 1, BLOCKED_MIN_LENGTH - 1)
    assert use_blocked(True, 3, 3) and not use_blocked(False, 10**5, 10**5)
    symbolic = jax.export.symbolic_shape("T")[0]
    assert not use_blocked(True, symbolic, symbolic)


def _has_loop(fn, *args) -> bool:
    return "while" in str(jax.make_jaxpr(fn)(*args))


def test_self_attention_picks_the_blocked_path_from_the_threshold(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey())
    assert _has_loop(m, jnp.zeros((BLOCKED_MIN_LENGTH, 8)))
    assert not _has_loop(m, jnp.zeros((BLOCKED_MIN_LENGTH - 1, 8)))
    forced = MultiHeadSelfAttention(8, 2, getkey(), memory_efficient=True)
    assert _has_loop(forced, jnp.zeros((4, 8)))
    never = MultiHeadSelfAttention(8, 2, getkey(), memory_efficient=False)
    assert not _has_loop(never, jnp.zeros((BLOCKED_MIN_LENGTH, 8)))


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_memory_efficient_must_be_a_bool_or_none(getkey, bad):
    with pytest.raises(ValueError, match="memory_efficient"):
        MultiHeadSelfAttention(8, 2, getkey(), memory_efficient=bad)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 3)])
def test_block_paths_agree_with_padding(getkey, causal, window):
    key, x = getkey(), jax.random.normal(getkey(), (13, 16))
    mask = jnp.arange(13) < 10
    paths = [
        TransformerBlock(16, 4, 32, key, causal=causal, window=window, memory_efficient=flag)
        for flag in (True, False)
    ]
    blocked, dense = (p(x, mask=mask) for p in paths)
    np.testing.assert_allclose(blocked, dense, atol=2e-5)

    def loss(block, x):
        return jnp.sum(block(x, mask=mask) ** 2)

    g_blocked, g_dense = (eqx.filter_grad(loss)(p, x) for p in paths)
    for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_cross_attention_and_models_paths_agree(getkey):
    key, x, context = (
        getkey(),
        jax.random.normal(getkey(), (7, 8)),
        jax.random.normal(getkey(), (9, 6)),
    )
    context_mask = jnp.arange(9) < 5
    cross = [MultiHeadCrossAttention(8, 2, key, 6, memory_efficient=f) for f in (True, False)]
    a, b = (c(x, context, context_mask=context_mask) for c in cross)
    np.testing.assert_allclose(a, b, atol=2e-6)

    arguments = dict(n_in=3, d_model=8, n_heads=2, d_ff=16, depth=2, n_out=4, max_len=12)
    inputs = jax.random.normal(getkey(), (12, 3))
    encoders = [
        transformer_encoder(**arguments, key=key, memory_efficient=f) for f in (True, False)
    ]
    np.testing.assert_allclose(encoders[0](inputs), encoders[1](inputs), atol=2e-6)
    decoders = [
        transformer_decoder(**arguments, key=key, d_context=6, memory_efficient=f)
        for f in (True, False)
    ]
    np.testing.assert_allclose(
        decoders[0](inputs, context, context_mask=context_mask),
        decoders[1](inputs, context, context_mask=context_mask),
        atol=2e-6,
    )


def test_shape_polymorphic_export_takes_the_materialised_path(getkey):
    m = MultiHeadSelfAttention(8, 2, getkey(), causal=True, memory_efficient=True)
    (t,) = jax.export.symbolic_shape("T")
    exported = jax.export.export(jax.jit(lambda x: m(x)))(jax.ShapeDtypeStruct((t, 8), jnp.float32))
    x = jax.random.normal(getkey(), (6, 8))
    np.testing.assert_allclose(exported.call(x), m(x), atol=2e-6)


# memory


def test_blocked_gradient_needs_memory_linear_in_the_length(getkey):
    """XLA's buffer assignment for forward+backward at T=4096 (2 heads): the blocked path's
    temporaries stay far below one `(heads, T, T)` float32 score array (128 MiB)."""
    heads, t, d = 2, 4096, 16
    q = jax.ShapeDtypeStruct((heads, t, d), jnp.float32)
    scores_bytes = heads * t * t * 4

    def temp_bytes(attend):
        grad = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
        return grad.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes

    blocked = temp_bytes(lambda q, k, v: blocked_attention(q, k, v, causal=True))
    assert blocked < scores_bytes / 8
    # The check can fail: the materialised path needs at least the scores.
    from dense_armor.utility.neural import scaled_dot_product_attention

    dense = temp_bytes(lambda q, k, v: scaled_dot_product_attention(q, k, v))
    assert dense >= scores_bytes
