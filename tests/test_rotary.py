"""Rotary positions (`positions="rope"`, `rope_base`): the rotation against Equinox's
`RotaryPositionalEmbedding` and a float64 NumPy reference; attention that depends only on how far
apart two steps are; streams (fixed, growing, ring) equal to the forward, a windowed one running
far past `max_len`; padding; export."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.checkpoints import ModelConfig
from dense_armor.export import check_golden, export_model, load
from dense_armor.nn.kernels.rotary import rotate
from dense_armor.utility.neural import (
    MultiHeadSelfAttention,
    transformer_decoder,
    transformer_encoder,
)
from streams import prefix_outputs, stream

KEY = jax.random.PRNGKey(0)


def numpy_rotation(x, positions, base):
    """Float64, feature by feature: `i` and `i + d/2` rotate together by `p * base**(-2i/d)`."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    for row, p in enumerate(positions):
        for i in range(half):
            angle = p * base ** (-2.0 * i / x.shape[-1])
            a, b = x[..., row, i], x[..., row, i + half]
            out[..., row, i] = a * np.cos(angle) - b * np.sin(angle)
            out[..., row, i + half] = b * np.cos(angle) + a * np.sin(angle)
    return out


def test_the_rotation_against_equinox_and_float64():
    x = jax.random.normal(KEY, (9, 8))
    np.testing.assert_allclose(rotate(x, jnp.arange(9)), eqx.nn.RotaryPositionalEmbedding(8)(x))
    positions = np.array([0, 3, 17, 250, 4096])
    for base in (10000.0, 500.0):
        np.testing.assert_allclose(
            rotate(x[:5], jnp.asarray(positions), base),
            numpy_rotation(x[:5], positions, base),
            atol=2e-5,  # float32 angles at position 4096
        )


def test_rotated_scores_depend_only_on_the_distance():
    q, k = jax.random.normal(KEY, (2, 1, 16))
    scores = [
        float((rotate(q, jnp.array([t + 5]), 100.0) * rotate(k, jnp.array([t]), 100.0)).sum())
        for t in (0, 7, 300)
    ]
    np.testing.assert_allclose(scores, scores[0], rtol=1e-4)


@pytest.mark.parametrize("implementation", ["materialised", "blocked", "xla"])
def test_every_implementation_rotates_the_same(implementation):
    x = jax.random.normal(KEY, (12, 16))
    mask = jnp.arange(12) < 9
    plain = MultiHeadSelfAttention(16, 2, KEY, causal=True, rope_base=10000.0)
    other = MultiHeadSelfAttention(
        16, 2, KEY, causal=True, rope_base=10000.0, implementation=implementation
    )
    np.testing.assert_allclose(other(x, mask=mask), plain(x, mask=mask), atol=1e-5)
    # padding at the end changes nothing for the valid steps
    np.testing.assert_allclose(plain(x, mask=mask)[:9], plain(x[:9]), atol=1e-5)
    # and the positions matter: without them the layer is another function
    unrotated = MultiHeadSelfAttention(16, 2, KEY, causal=True)
    assert float(jnp.abs(unrotated(x) - plain(x)).max()) > 1e-3


@pytest.mark.parametrize("capacity", [16, None])
def test_a_rope_encoder_streams_like_its_forward(capacity):
    model = transformer_encoder(3, 16, 4, 32, 2, 4, KEY, 16, causal=True, positions="rope")
    assert len(model.layers) == 5  # Dense, 2 blocks, mean, Dense: no positional layer
    xs = jax.random.normal(KEY, (16 if capacity else 6, 3))  # a growing cache recompiles
    stepped, _ = stream(
        model, xs, model.init_cache(capacity, on_overflow="nan"), eqx.filter_jit(model.step)
    )
    np.testing.assert_allclose(stepped, prefix_outputs(model, xs), atol=2e-5)
    y, cache = eqx.filter_jit(model.prefill)(xs[:4], model.init_cache(capacity, on_overflow="nan"))
    more, _ = eqx.filter_jit(model.prefill)(xs[4:], cache)
    np.testing.assert_allclose(jnp.concatenate([y, more]), stepped, atol=2e-5)


def test_a_windowed_rope_stream_runs_far_past_max_len():
    """max_len 8, window 4, 300 steps: the ring folds its counter, the rotation only sees
    distances, and every step equals attention over the last 4 steps computed from scratch."""
    model = transformer_decoder(
        3, 16, 2, 32, 1, 4, KEY, 8, d_context=5, window=4, positions="rope", rope_base=1000.0
    )
    assert model.positions is None
    xs = jax.random.normal(KEY, (300, 3))
    context = jax.random.normal(jax.random.fold_in(KEY, 1), (3, 5))
    cache = model.init_cache(context)
    step = eqx.filter_jit(model.step)
    for t in range(300):
        y, cache = step(xs[t], cache)
        if t in (3, 150, 299):  # a window's worth, from scratch: the same relative positions
            start = max(0, t - 3)
            fresh = model(xs[start : t + 1], context)[-1]
            np.testing.assert_allclose(y, fresh, atol=2e-5, err_msg=str(t))


def test_a_grouped_rotary_windowed_model_exports_past_max_len(tmp_path):
    config = ModelConfig(
        "transformer_encoder",
        {"n_in": 3, "d_model": 16, "n_heads": 4, "d_ff": 32, "depth": 1, "n_out": 4,
         "max_len": 8, "causal": True, "positions": "rope", "n_kv_heads": 2, "window": 4},
    )  # fmt: skip
    model = config.build(KEY)
    export_model(model, config, tmp_path / "art", capacity=12, platforms=["cpu"], static_shapes=[])
    artifact = load(tmp_path / "art")
    # the exported step of a grouped-query, rotary, windowed model: 12 steps, past max_len and
    # around the ring of 4 three times, against the Python model's own steps
    assert max(check_golden(artifact).values()) < 1e-5
    keys = artifact.manifest["streaming"]["layout"][0]
    assert keys["path"] == "cache[1].keys" and keys["shape"] == ["B", 2, 4, 4]
    assert keys["holders"] == ["RingKVCache"]
