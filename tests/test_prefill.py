"""The streaming-state protocol: chunked prefill and per-stream reset, for every cache kind and
every streaming model family, against the step loop and `forward` on the prefixes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.nn.kernels import blocked
from dense_armor.utility.neural import (
    CannotStream,
    FixedKVCache,
    KVCache,
    MultiHeadSelfAttention,
    RingKVCache,
    TransformerBlock,
    TransformerDecoderBlock,
    reset,
    transformer_decoder,
    transformer_encoder,
)
from streams import prefix_outputs, stream

KEY = jax.random.PRNGKey(3)
STEPS = 16


def encoder(depth=1, **options):
    """One block: threading caches through several is tested in tests/test_streaming.py."""
    return transformer_encoder(3, 16, 2, 32, depth, 4, KEY, STEPS, causal=True, **options)


FAMILIES = {
    # name: (model, capacity, cache kind, tolerance)
    "encoder, fixed": (encoder(depth=2), STEPS, FixedKVCache, 2e-5),
    "encoder, growing": (encoder(), None, KVCache, 2e-5),
    "encoder, windowed": (encoder(window=5), None, RingKVCache, 2e-5),
    "pre-LN, learned positions": (
        encoder(norm_first=True, positions="learned"),
        STEPS,
        FixedKVCache,
        2e-5,
    ),
    "encoder, bfloat16": (encoder(compute_dtype="bfloat16"), STEPS, FixedKVCache, 6e-2),
}
# Chunks of one are the step loop itself (`step` is a prefill of one row): the reference below.
CHUNKS = {"sevens": [7, 7, 2], "whole": [STEPS], "mixed": [7, 1, 8]}


def chunked(model, xs, cache, sizes, prefill=None):
    """Prefill `xs` in chunks of `sizes`; the outputs stacked, and the last cache."""
    prefill = prefill or eqx.filter_jit(model.prefill)
    outputs, start = [], 0
    for size in sizes:
        y, cache = prefill(xs[start : start + size], cache)
        outputs.append(y)
        start += size
    return jnp.concatenate(outputs), cache


def as32(a):
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_in_chunks_equals_steps_and_forward_on_every_prefix(family):
    model, capacity, kind, atol = FAMILIES[family]
    xs = jax.random.normal(jax.random.fold_in(KEY, 1), (STEPS, 3))
    cache = model.init_cache(capacity, on_overflow="nan")
    assert any(isinstance(layer_cache, kind) for layer_cache in cache)
    # A growing cache changes shape at every step, so each step and chunk compiles anew, jitted
    # (fixed and ring caches compile once): still quicker than its dozens of eager operations
    # compiled at every length (tests/streams.py has the figures).
    step, prefill = eqx.filter_jit(model.step), eqx.filter_jit(model.prefill)
    stepped, _ = stream(model, xs, cache, step)
    np.testing.assert_allclose(as32(stepped), as32(prefix_outputs(model, xs, atol=atol)), atol=atol)
    for name, sizes in CHUNKS.items():
        ys, _ = chunked(model, xs, cache, sizes, prefill)
        np.testing.assert_allclose(as32(ys), as32(stepped), atol=atol, err_msg=name)
    # the stream goes on from a prefilled cache as from a stepped one
    _, stepped_cache = stream(model, xs[:9], cache, step)
    _, prefilled_cache = chunked(model, xs[:9], cache, [7, 2], prefill)
    extra = jax.random.normal(jax.random.fold_in(KEY, 2), (3,))
    np.testing.assert_allclose(
        as32(step(extra, prefilled_cache)[0]), as32(step(extra, stepped_cache)[0]), atol=atol
    )


def test_a_ring_prefill_longer_than_the_window_keeps_the_last_steps():
    m = MultiHeadSelfAttention(8, 2, KEY, causal=True, window=3)
    xs = jax.random.normal(KEY, (11, 8))
    stepped, ring = stream(m, xs, m.init_cache())
    for sizes in ([11], [2, 9], [4, 4, 3]):
        ys, after = chunked(m, xs, m.init_cache(), sizes)
        np.testing.assert_allclose(ys, stepped, atol=1e-5)
        np.testing.assert_array_equal(after.index, ring.index)
        np.testing.assert_allclose(after.keys, ring.keys, atol=1e-6)
    np.testing.assert_allclose(stepped, m(xs), atol=1e-5)


def test_decoder_prefill_equals_its_steps_and_forward():
    model = transformer_decoder(3, 8, 2, 16, 1, 4, KEY, STEPS, d_context=5)
    xs = jax.random.normal(KEY, (STEPS, 3))
    context = jax.random.normal(jax.random.fold_in(KEY, 9), (6, 5))
    mask = jnp.arange(6) < 4
    full = model(xs, context, context_mask=mask)
    prefill = eqx.filter_jit(model.prefill)
    for capacity in (None, STEPS):
        cache = model.init_cache(context, capacity, context_mask=mask, on_overflow="nan")
        for sizes in CHUNKS.values():
            ys, _ = chunked(model, xs, cache, sizes, prefill=prefill)
            np.testing.assert_allclose(ys, full, atol=2e-5)


@pytest.mark.parametrize("window, capacity", [(None, STEPS), (5, None), (None, None)])
def test_a_long_chunk_goes_through_in_pieces_with_the_same_result(monkeypatch, window, capacity):
    """With the scores bound lowered to 8 ** 2 entries per head, a chunk of 13 rows against 13
    or more keys goes through in pieces (a scan for fixed and ring caches, a loop for the growing
    one, and a remainder); outputs and cache are those of the whole chunk at once."""
    m = MultiHeadSelfAttention(8, 2, KEY, causal=True, window=window)
    xs = jax.random.normal(jax.random.fold_in(KEY, 7), (13, 8))
    stepped, _ = stream(m, xs, m.init_cache(capacity))
    whole, whole_cache = m.prefill(xs, m.init_cache(capacity))
    assert m._piece_rows(xs, m.init_cache(capacity)) is None
    monkeypatch.setattr(blocked, "BLOCKED_MIN_LENGTH", 8)
    rows = m._piece_rows(xs, m.init_cache(capacity))
    assert rows is not None and 1 < rows < 13 and 13 % rows  # pieces and a remainder
    pieces, pieces_cache = eqx.filter_jit(m.prefill)(xs, m.init_cache(capacity))
    np.testing.assert_allclose(pieces, whole, atol=1e-5)
    np.testing.assert_allclose(pieces, stepped, atol=1e-5)
    for a, b in zip(jax.tree.leaves(pieces_cache), jax.tree.leaves(whole_cache), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("window, capacity", [(None, 8), (3, None)])
def test_a_batch_of_streams_writes_its_cache_as_each_stream_alone(window, capacity):
    """The cache's row writes under `jax.vmap` (a scatter with a batching dimension, the form
    the static modules carry) against each stream run alone: chunks longer than the ring, a step
    past the capacity, a non-finite key written as NaN."""
    m = MultiHeadSelfAttention(8, 2, KEY, causal=True, window=window)
    xs = jax.random.normal(jax.random.fold_in(KEY, 11), (2, 10, 8))
    xs = xs.at[1, 4].set(jnp.nan)

    def run(x):
        cache = m.init_cache(capacity, on_overflow="nan")
        ys, cache = m.prefill(x[:7], cache)
        more, cache = m.prefill(x[7:], cache)
        return jnp.concatenate([ys, more]), cache

    batched, batched_cache = jax.jit(jax.vmap(run))(xs)
    for b in range(2):
        alone, alone_cache = jax.jit(run)(xs[b])
        np.testing.assert_allclose(batched[b], alone, atol=1e-6)  # NaN where alone has NaN
        pairs = zip(jax.tree.leaves(batched_cache), jax.tree.leaves(alone_cache), strict=True)
        for a, c in pairs:
            np.testing.assert_allclose(a[b], c, atol=1e-6)
    if window is None:  # stream 1's NaN key in its row and only there; steps 8, 9 overflowed
        nan_rows = np.isnan(np.asarray(batched_cache.keys[1])).any(axis=(0, 2))
        assert nan_rows.tolist() == [i == 4 for i in range(capacity)]
        assert np.isnan(np.asarray(batched[0, 8:])).all() and np.isfinite(batched[0, :8]).all()


def test_a_whole_model_prefills_in_pieces_and_keeps_the_overflow_rules(monkeypatch):
    model = encoder()
    xs = jax.random.normal(jax.random.fold_in(KEY, 8), (STEPS + 2, 3))
    expected, _ = model.prefill(xs, model.init_cache(STEPS, on_overflow="nan"))
    monkeypatch.setattr(blocked, "BLOCKED_MIN_LENGTH", 8)
    ys, cache = eqx.filter_jit(model.prefill)(xs, model.init_cache(STEPS, on_overflow="nan"))
    np.testing.assert_allclose(ys[:STEPS], expected[:STEPS], atol=2e-5)
    assert bool(jnp.isnan(ys[STEPS:]).all()) and bool(jnp.isfinite(ys[:STEPS]).all())
    assert bool(cache[2].overflow) and int(cache[2].index) == STEPS


@pytest.mark.parametrize("layer", ["attention", "block"])
def test_prefill_past_the_capacity_is_never_silent(layer):
    m = (
        MultiHeadSelfAttention(8, 2, KEY, causal=True)
        if layer == "attention"
        else TransformerBlock(8, 2, 16, KEY, causal=True)
    )
    xs = jax.random.normal(KEY, (10, 8))
    stepped, _ = stream(m, xs[:8], m.init_cache(8))
    ys, cache = m.prefill(xs, m.init_cache(8, on_overflow="nan"))
    np.testing.assert_allclose(ys[:8], stepped, atol=1e-5)
    assert bool(jnp.isnan(ys[8:]).all()) and bool(cache.overflow) and int(cache.index) == 8
    # a chunk that starts in an overflowed cache is NaN throughout, and the rows stay as they were
    more, again = m.prefill(xs[:2], cache)
    assert bool(jnp.isnan(more).all()) and bool(again.overflow)
    np.testing.assert_array_equal(again.keys, cache.keys)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"cache is full \(capacity 8\)"):
        m.prefill(xs, m.init_cache(8))[0].block_until_ready()


def test_positions_prefill_past_max_len_follows_the_step_rules():
    model = encoder()
    xs = jnp.ones((STEPS + 2, 3))
    ys, cache = model.prefill(xs, model.init_cache(STEPS + 4, on_overflow="nan"))
    assert bool(jnp.isfinite(ys[:STEPS]).all()) and bool(jnp.isnan(ys[STEPS:]).all())
    assert bool(cache[1].overflow) and int(cache[1].index) == STEPS


def test_layers_that_cannot_stream_say_so_with_one_exception():
    plain = MultiHeadSelfAttention(8, 2, KEY)
    causal = MultiHeadSelfAttention(8, 2, KEY, causal=True)
    with pytest.raises(CannotStream, match="causal=True"):
        plain.prefill(jnp.ones((2, 8)), causal.init_cache(4))
    with pytest.raises(CannotStream, match="causal=True"):
        transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6).init_cache(4)
    assert issubclass(CannotStream, ValueError)


# A batch of streams: per-stream counters and reset


@pytest.mark.parametrize("window", [None, 3])
def test_reset_streams_restart_alone_and_leave_the_others_untouched(window):
    model = encoder(window=window) if window else encoder()
    n, t_reset = 4, 6
    xs = jax.random.normal(jax.random.fold_in(KEY, 5), (n, 12, 3))
    caches = model.init_streams(n, None if window else STEPS, on_overflow="nan")
    assert all(jnp.shape(leaf)[0] == n for leaf in jax.tree.leaves(caches))
    step = jax.jit(jax.vmap(lambda x_t, cache: model.step(x_t, cache)))
    outputs = []
    for t in range(12):
        if t == t_reset:
            caches = reset(caches, jnp.array([False, True, False, True]))
        y, caches = step(xs[:, t], caches)
        outputs.append(y)
    outputs = jnp.stack(outputs, axis=1)  # (streams, steps, n_out)
    for s in range(n):
        start = t_reset if s in (1, 3) else 0
        alone, _ = stream(
            model, xs[s, start:], model.init_cache(None if window else STEPS, on_overflow="nan")
        )
        np.testing.assert_allclose(outputs[s, start:], alone, atol=2e-5, err_msg=f"stream {s}")
    if not window:  # each stream's own counter: the reset ones saw 6 steps, the others 12
        np.testing.assert_array_equal(caches[2].index, [12, 6, 12, 6])


def test_reset_refuses_what_it_cannot_reset():
    model = encoder()
    with pytest.raises(ValueError, match="growing cache"):
        reset(model.init_cache(), jnp.array([True]))
    caches = model.init_streams(2, 8)
    with pytest.raises(ValueError, match="leading axis of 3 streams"):
        reset(caches, jnp.array([True, False, True]))
    with pytest.raises(ValueError, match="boolean vector"):
        reset(caches, jnp.array([1, 0]))
    with pytest.raises(ValueError, match="`batch` must be a positive integer"):
        model.init_streams(0, 8)


# The decoder block's pre-LN and window options


def test_pre_ln_decoder_block_by_its_equations():
    d = TransformerDecoderBlock(8, 2, 16, KEY, d_context=5, norm_first=True)
    x = jax.random.normal(KEY, (6, 8))
    context = jax.random.normal(jax.random.fold_in(KEY, 1), (4, 5))
    y = x + d.self_attention(d.norm1(x))
    u = y + d.cross_attention(d.norm2(y), context)
    np.testing.assert_allclose(d(x, context), u + d.feed_forward(d.norm3(u)), atol=1e-5)


@pytest.mark.parametrize("norm_first, window", [(True, None), (False, 3), (True, 3)])
def test_pre_ln_and_windowed_decoders_stream_and_prefill(norm_first, window):
    model = transformer_decoder(
        3, 8, 2, 16, 1, 4, KEY, 8, d_context=5, norm_first=norm_first, window=window
    )
    assert (model.final_norm is not None) == norm_first
    xs = jax.random.normal(KEY, (12 if window else 8, 3))  # a windowed one runs past max_len
    context = jax.random.normal(jax.random.fold_in(KEY, 9), (6, 5))
    full = model(xs, context)
    cache = model.init_cache(context, None if window else 8, on_overflow="nan")
    if window:
        assert isinstance(cache[1].self_attention, RingKVCache)
    stepped, _ = stream(model, xs, cache, eqx.filter_jit(model.step))
    np.testing.assert_allclose(stepped, full, atol=2e-5)
    ys, _ = chunked(model, xs, cache, [5, len(xs) - 5])
    np.testing.assert_allclose(ys, full, atol=2e-5)
