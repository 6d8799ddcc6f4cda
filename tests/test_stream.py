"""`Stream`: a stream stepped from Python equals the model's forward on the steps it was given,
raises before the step that would pass its limit (leaving everything as it was), and compiles
once per shape. Its limit is the counters' static `limit`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.utility.neural import (
    GRU,
    CannotStream,
    MultiHeadSelfAttention,
    ShapeError,
    Stream,
    TransformerDecoderBlock,
    transformer_encoder,
)

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (12, 8))
LAYER = MultiHeadSelfAttention(8, 2, KEY, causal=True)


def test_steps_and_prefills_equal_the_forward_and_raise_past_the_capacity():
    stream = Stream(LAYER, 6)
    assert (stream.limit, stream.position) == (6, 0)
    ys = [stream.step(X[0]), stream.prefill(X[1:4]), stream.step(X[4])]
    np.testing.assert_allclose(
        np.concatenate([ys[0][None], ys[1], ys[2][None]]), LAYER(X[:5]), atol=1e-6
    )
    cache = stream.cache
    assert stream.position == 5 and int(cache.index) == 5 and cache.on_overflow == "nan"
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"5 of its 6 steps taken, .* needs 2"):
        stream.prefill(X[5:7])
    # nothing ran: the position, the cache and the next step are those of a stream at 5
    assert stream.position == 5
    np.testing.assert_array_equal(stream.cache.keys, cache.keys)
    np.testing.assert_allclose(stream.step(X[5]), LAYER(X[:6])[5], atol=1e-6)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"Stream.step: the stream is full"):
        stream.step(X[6])
    assert not bool(stream.cache.overflow)  # the device never saw an overflowing step
    stream.reset()
    assert stream.position == 0
    np.testing.assert_allclose(stream.prefill(X[6:12]), LAYER(X[6:12]), atol=1e-6)


def test_the_limit_is_the_smallest_counter_limit_and_a_ring_has_none():
    # the encoder's positional table (max_len 4) is shorter than its caches (capacity 8)
    encoder = transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 4, causal=True)
    stream = Stream(encoder, 8)
    assert stream.limit == 4
    xs = X[:4, :3]
    outputs = [stream.step(x) for x in xs]
    # the encoder pools over time: its step t is its forward on the first t + 1 samples
    expected = [encoder(xs[: t + 1]) for t in range(4)]
    np.testing.assert_allclose(np.stack(outputs), np.stack(expected), atol=1e-5)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"4 of its 4 steps"):
        stream.step(xs[0])
    # a sliding window never fills, nor does a recurrent state: no limit, any number of steps
    for model in (
        MultiHeadSelfAttention(8, 2, KEY, causal=True, window=3),
        GRU(8, 8, KEY),
    ):
        stream = Stream(model, None)
        assert stream.limit is None
        outputs = [stream.step(x) for x in X]
        np.testing.assert_allclose(np.stack(outputs), model(X), atol=1e-5)


def test_one_compilation_per_shape_and_the_cache_is_a_copy():
    stream = Stream(LAYER, 12)
    held = stream.cache
    for t in range(5):
        stream.step(X[t])
    stream.prefill(X[5:8])
    stream.prefill(X[8:11])
    assert stream._run["step"]._cache_size() == 1 and stream._run["prefill"]._cache_size() == 1
    # the copy taken before the steps is still readable: the donated buffers were the stream's
    assert int(held.index) == 0 and float(jnp.abs(held.keys).sum()) == 0.0


def test_bad_inputs_leave_the_stream_as_it_was():
    stream = Stream(LAYER, 4)
    stream.step(X[0])
    with pytest.raises(ShapeError):
        stream.step(jnp.ones(5))
    with pytest.raises(TypeError, match=r"Stream.prefill: expected a chunk of steps"):
        stream.prefill(jnp.float32(1.0))
    assert stream.position == 1
    np.testing.assert_allclose(stream.step(np.asarray(X[1])), LAYER(X[:2])[1], atol=1e-6)
    assert stream.prefill(X[:0]).shape == (0, 8) and stream.position == 2
    with pytest.raises(CannotStream):
        Stream(MultiHeadSelfAttention(8, 2, KEY), 4)


def test_counters_carry_their_limit():
    assert LAYER.init_cache(5).counter.limit == 5
    encoder = transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 4, causal=True)
    limits = {
        type(node).__name__: node.counter.limit
        for node in jax.tree_util.tree_leaves(
            encoder.init_cache(8), is_leaf=lambda node: hasattr(node, "counter")
        )
        if hasattr(node, "counter")
    }
    assert limits == {"PositionCache": 4, "FixedKVCache": 8}


def test_a_decoder_streams_against_its_context():
    decoder = TransformerDecoderBlock(8, 2, 16, KEY, d_context=3, gate=True)
    context = jax.random.normal(jax.random.PRNGKey(2), (4, 3))
    mask = jnp.array([True, False, True, True])
    stream = Stream(decoder, 6, context=context, context_mask=mask)
    full = decoder(X[:6], context, context_mask=mask)
    np.testing.assert_allclose(stream.prefill(X[:2]), full[:2], atol=1e-5)
    np.testing.assert_allclose(np.stack([stream.step(x) for x in X[2:6]]), full[2:], atol=1e-5)
    stream.reset()  # the same context again
    np.testing.assert_allclose(stream.step(X[0]), full[0], atol=1e-5)
    assert mask.tolist() == [True, False, True, True]  # the caller's arrays were never donated
    with pytest.raises(TypeError, match=r"streams against a context: pass `context=`"):
        Stream(decoder, 6)
    with pytest.raises(TypeError, match=r"MultiHeadSelfAttention takes no context"):
        Stream(LAYER, 6, context=context)


def test_a_language_model_streams_its_tokens():
    lm = TransformerLM(50, 16, 2, 32, 1, KEY, 8)
    ids = jnp.array([3, 1, 4, 1, 5], jnp.int32)
    stream = Stream(lm, 8)
    logits = np.concatenate([stream.prefill(ids[:3]), np.stack([stream.step(i) for i in ids[3:]])])
    np.testing.assert_allclose(logits, lm(ids), atol=1e-5)
    assert stream.position == 5 and stream.limit == 8
