"""Grouped-query attention (`n_kv_heads`): against multi-head attention whose key and value
projections repeat each key/value head for its group of query heads (query head `h` uses
key/value head `h // (n_heads / n_kv_heads)`), for every implementation; streaming with caches
that hold only the key/value heads; export."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.checkpoints import ModelConfig
from dense_armor.export import check_golden, export_model, load
from dense_armor.utility.neural import (
    MultiHeadCrossAttention,
    MultiHeadSelfAttention,
    transformer_decoder,
)
from streams import prefix_outputs, stream

KEY = jax.random.PRNGKey(0)
D, HEADS, KV = 16, 4, 2
D_HEAD, GROUP = D // HEADS, HEADS // KV


def repeat_heads(w, n_kv):
    """`(d_in, n_kv * d_head) -> (d_in, n_heads * d_head)`: each key/value head repeated for the
    query heads of its group, as multi-head attention would need it."""
    d_in = w.shape[0]
    return jnp.repeat(w.reshape(d_in, n_kv, D_HEAD), HEADS // n_kv, axis=1).reshape(d_in, D)


def as_multi_head(gqa, reference):
    """`reference` (a multi-head layer) with `gqa`'s weights, keys and values repeated."""
    return eqx.tree_at(
        lambda m: (m.W_Q.value, m.W_K.value, m.W_V.value, m.W_O.value),
        reference,
        (
            gqa.W_Q.value,
            repeat_heads(gqa.W_K.value, gqa.n_kv_heads),
            repeat_heads(gqa.W_V.value, gqa.n_kv_heads),
            gqa.W_O.value,
        ),
    )


@pytest.mark.parametrize("implementation", ["materialised", "blocked", "xla"])
@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"causal": True, "window": 3}],
    ids=["full", "causal", "window"],
)
@pytest.mark.parametrize("n_kv", [KV, 1])
def test_grouped_query_attention_is_multi_head_attention_with_repeated_heads(
    implementation, options, n_kv
):
    layer = MultiHeadSelfAttention(
        D, HEADS, KEY, n_kv_heads=n_kv, implementation=implementation, **options
    )
    assert layer.W_K.value.shape == layer.W_V.value.shape == (D, n_kv * D_HEAD)
    reference = as_multi_head(layer, MultiHeadSelfAttention(D, HEADS, KEY, **options))
    x = jax.random.normal(jax.random.fold_in(KEY, 1), (10, D))
    mask = jnp.arange(10) < 7
    np.testing.assert_allclose(layer(x, mask=mask), reference(x, mask=mask), atol=1e-5)
    grad = jax.grad(lambda x, m: (m(x, mask=mask) ** 2).sum())
    np.testing.assert_allclose(grad(x, layer), grad(x, reference), atol=1e-4)
    np.testing.assert_allclose(
        layer.attention_weights(x, mask=mask), reference.attention_weights(x, mask=mask), atol=1e-6
    )


def test_grouped_cross_attention_is_multi_head_cross_attention_with_repeated_heads():
    layer = MultiHeadCrossAttention(D, HEADS, KEY, 5, n_kv_heads=1)
    reference = as_multi_head(layer, MultiHeadCrossAttention(D, HEADS, KEY, 5))
    x = jax.random.normal(KEY, (6, D))
    context = jax.random.normal(jax.random.fold_in(KEY, 2), (4, 5))
    context_mask = jnp.array([True, True, False, True])
    expected = reference(x, context, context_mask=context_mask)
    np.testing.assert_allclose(layer(x, context, context_mask=context_mask), expected, atol=1e-5)
    cache = layer.init_cache(context, context_mask=context_mask)
    assert cache.keys.shape == (4, D_HEAD)  # one key/value head
    np.testing.assert_allclose(layer.step(x[3], cache)[0], expected[3], atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_the_cache_holds_only_the_key_value_heads_and_streams_exactly(window):
    layer = MultiHeadSelfAttention(D, HEADS, KEY, causal=True, window=window, n_kv_heads=KV)
    full = MultiHeadSelfAttention(D, HEADS, KEY, causal=True, window=window)
    capacity = None if window else 12
    cache, full_cache = (
        layer.init_cache(12, on_overflow="nan"),
        full.init_cache(12, on_overflow="nan"),
    )
    assert cache.keys.nbytes * HEADS == full_cache.keys.nbytes * KV  # exactly n_kv / n_heads
    xs = jax.random.normal(jax.random.fold_in(KEY, 3), (12, D))
    stepped, _ = stream(
        layer, xs, layer.init_cache(capacity, on_overflow="nan"), eqx.filter_jit(layer.step)
    )
    np.testing.assert_allclose(stepped, layer(xs), atol=2e-5)
    y, cache = eqx.filter_jit(layer.prefill)(xs[:7], layer.init_cache(capacity, on_overflow="nan"))
    more, _ = eqx.filter_jit(layer.prefill)(xs[7:], cache)
    np.testing.assert_allclose(jnp.concatenate([y, more]), stepped, atol=2e-5)
    growing, _ = stream(layer, xs[:5], layer.init_cache())  # growing, or the ring
    np.testing.assert_allclose(growing, stepped[:5], atol=2e-5)


def test_a_multi_query_decoder_exports_and_matches_its_python_model(tmp_path):
    arguments = {"n_in": 3, "d_model": D, "n_heads": HEADS, "d_ff": 32, "depth": 1, "n_out": 4}
    config = ModelConfig(
        "transformer_decoder", {**arguments, "max_len": 8, "d_context": 5, "n_kv_heads": 1}
    )
    model = config.build(KEY)
    assert isinstance(model, type(transformer_decoder(**arguments, key=KEY, max_len=8)))
    export_model(model, config, tmp_path / "art", platforms=["cpu"], static_shapes=[])
    artifact = load(tmp_path / "art")
    assert max(check_golden(artifact).values()) < 1e-5
    layout = {e["path"]: e["shape"] for e in artifact.manifest["streaming"]["layout"]}
    assert layout["cache[1].self_attention.keys"] == ["B", 1, 8, D_HEAD]
    assert layout["cache[1].context.keys"] == ["B", "S", D_HEAD]


def test_an_encoder_with_grouped_heads_streams_like_its_forward():
    from dense_armor.utility.neural import transformer_encoder

    model = transformer_encoder(3, D, HEADS, 32, 2, 4, KEY, 10, causal=True, n_kv_heads=KV)
    xs = jax.random.normal(KEY, (10, 3))
    stepped, _ = stream(
        model, xs, model.init_cache(10, on_overflow="nan"), eqx.filter_jit(model.step)
    )
    np.testing.assert_allclose(stepped, prefix_outputs(model, xs), atol=2e-5)


def test_default_key_value_heads_change_nothing():
    plain = MultiHeadSelfAttention(D, HEADS, KEY, causal=True)
    explicit = MultiHeadSelfAttention(D, HEADS, KEY, causal=True, n_kv_heads=HEADS)
    assert plain.n_kv_heads == HEADS and len(plain.params()) == 4
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(explicit), strict=True):
        np.testing.assert_array_equal(a, b)
