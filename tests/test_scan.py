"""Deep models: the blocks stacked and scanned (`scan_layers=True`) compute what the unrolled
blocks compute with the same weights, forward, backward and streaming; checkpoints convert both
ways; export works; `remat` recomputes without changing a gradient; every attention
`implementation` computes the same function, and cuDNN's never reaches an export."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.checkpoints import ModelConfig, load_checkpoint, save_checkpoint
from dense_armor.export import check_golden, export_model, load
from dense_armor.utility.neural import (
    MultiHeadCrossAttention,
    MultiHeadSelfAttention,
    Stack,
    TransformerBlock,
    reset,
    stack_layers,
    transformer_decoder,
    transformer_encoder,
    unstack_layers,
)
from streams import stream

KEY = jax.random.PRNGKey(0)
ARGS = {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 3, "n_out": 4, "max_len": 10}


def encoder(**options):
    return transformer_encoder(**ARGS, key=KEY, causal=True, **options)


def leaves_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=atol)


def test_scanned_encoder_equals_the_unrolled_one_forward_and_backward():
    unrolled, scanned = encoder(), encoder(scan_layers=True)
    assert isinstance(scanned.layers[2], Stack) and scanned.layers[2].depth == 3
    assert len(unrolled.layers) == len(scanned.layers) + 2
    x = jax.random.normal(KEY, (10, 3))
    mask = jnp.arange(10) < 7
    np.testing.assert_allclose(scanned(x), unrolled(x), atol=1e-6)
    np.testing.assert_allclose(scanned(x, mask=mask), unrolled(x, mask=mask), atol=1e-6)
    loss = eqx.filter_jit(eqx.filter_grad(lambda m: (m(x, mask=mask) ** 2).sum()))
    leaves_close(stack_layers(loss(unrolled)), loss(scanned), atol=1e-6)
    # the same weights, one stacked: converting is exact both ways
    leaves_close(stack_layers(unrolled), scanned, atol=0)
    leaves_close(unstack_layers(scanned), unrolled, atol=0)


def test_the_scanned_block_is_traced_once_whatever_the_depth():
    x = jnp.ones((10, 3))

    def size(model):
        return len(jax.make_jaxpr(model)(x).jaxpr.eqns)

    shallow = transformer_encoder(**{**ARGS, "depth": 2}, key=KEY, causal=True, scan_layers=True)
    deep = transformer_encoder(**{**ARGS, "depth": 8}, key=KEY, causal=True, scan_layers=True)
    assert size(shallow) == size(deep)
    unrolled = transformer_encoder(**{**ARGS, "depth": 8}, key=KEY, causal=True)
    assert size(unrolled) > 3 * size(deep)


@pytest.mark.parametrize("window", [None, 4])
def test_scanned_streams_prefill_and_reset_like_the_unrolled(window):
    unrolled, scanned = encoder(window=window), encoder(window=window, scan_layers=True)
    capacity = None if window else 10
    xs = jax.random.normal(jax.random.fold_in(KEY, 1), (10, 3))
    expected, _ = stream(unrolled, xs, unrolled.init_cache(capacity, on_overflow="nan"))
    cache = scanned.init_cache(capacity, on_overflow="nan")
    assert jax.tree.leaves(cache[2])[0].shape[0] == 3  # one cache per block, stacked
    stepped, _ = stream(scanned, xs, cache, eqx.filter_jit(scanned.step))
    np.testing.assert_allclose(stepped, expected, atol=2e-5)
    y, cache = eqx.filter_jit(scanned.prefill)(
        xs[:6], scanned.init_cache(capacity, on_overflow="nan")
    )
    more, _ = eqx.filter_jit(scanned.prefill)(xs[6:], cache)
    np.testing.assert_allclose(jnp.concatenate([y, more]), expected, atol=2e-5)
    # a batch of two streams, the second reset part-way: it restarts alone
    caches = scanned.init_streams(2, capacity, on_overflow="nan")
    step = jax.jit(jax.vmap(lambda x, c: scanned.step(x, c)))
    outputs = []
    for t in range(10):
        if t == 5:
            caches = reset(caches, jnp.array([False, True]))
        y, caches = step(jnp.stack([xs[t], xs[t]]), caches)
        outputs.append(y)
    outputs = jnp.stack(outputs, axis=1)
    np.testing.assert_allclose(outputs[0], expected, atol=2e-5)
    alone, _ = stream(unrolled, xs[5:], unrolled.init_cache(capacity, on_overflow="nan"))
    np.testing.assert_allclose(outputs[1, 5:], alone, atol=2e-5)


def test_scanned_decoder_equals_the_unrolled_one():
    decoder = transformer_decoder(**ARGS, key=KEY, d_context=5, norm_first=True, scan_layers=True)
    unrolled = unstack_layers(decoder)
    assert isinstance(decoder.blocks[0], Stack) and len(unrolled.blocks) == 3
    x = jax.random.normal(KEY, (10, 3))
    context = jax.random.normal(jax.random.fold_in(KEY, 2), (4, 5))
    mask = jnp.array([True, True, True, False])
    expected = unrolled(x, context, context_mask=mask)
    np.testing.assert_allclose(decoder(x, context, context_mask=mask), expected, atol=1e-6)
    cache = decoder.init_cache(context, 10, context_mask=mask, on_overflow="nan")
    y, _ = eqx.filter_jit(decoder.prefill)(x, cache)
    np.testing.assert_allclose(y, expected, atol=2e-5)


def test_checkpoints_convert_both_ways_and_export_works(tmp_path):
    config = ModelConfig("transformer_encoder", {**ARGS, "causal": True})
    unrolled = config.build(KEY)
    save_checkpoint(tmp_path / "unrolled", unrolled, config)
    scanned = load_checkpoint(tmp_path / "unrolled", scan_layers=True)
    assert scanned.config.arguments["scan_layers"] is True
    assert isinstance(scanned.model.layers[2], Stack)
    x = jax.random.normal(KEY, (10, 3))
    np.testing.assert_allclose(scanned.model(x), unrolled(x), atol=1e-6)
    save_checkpoint(tmp_path / "scanned", scanned.model, scanned.config)
    back = load_checkpoint(tmp_path / "scanned", scan_layers=False)
    assert "scan_layers" in back.config.arguments and not back.config.arguments["scan_layers"]
    leaves_close(back.model, unrolled, atol=0)
    assert load_checkpoint(tmp_path / "scanned").config == scanned.config  # as saved
    with pytest.raises(ValueError, match="`scan_layers` must be True or False"):
        load_checkpoint(tmp_path / "scanned", scan_layers="yes")

    # the scanned model exports: its cache arrays carry the depth axis after the batch
    export_model(
        scanned.model, scanned.config, tmp_path / "art", platforms=["cpu"], static_shapes=[]
    )
    artifact = load(tmp_path / "art")
    assert max(check_golden(artifact).values()) < 1e-5
    keys = next(e for e in artifact.manifest["streaming"]["layout"] if e["path"].endswith("keys"))
    assert keys["shape"] == ["B", 3, 2, 10, 4] and keys["holders"] == ["FixedKVCache"]
    np.testing.assert_allclose(artifact.forward(x[None]), unrolled(x)[None], atol=1e-5)


@pytest.mark.parametrize("remat", ["block", "attention"])
def test_remat_recomputes_without_changing_a_gradient(remat):
    x = jax.random.normal(KEY, (10, 3))
    plain, recomputed = encoder(scan_layers=True), encoder(scan_layers=True, remat=remat)
    loss = lambda m: (m(x) ** 2).sum()  # noqa: E731
    leaves_close(eqx.filter_grad(loss)(recomputed), eqx.filter_grad(loss)(plain), atol=1e-6)
    jaxpr = str(jax.make_jaxpr(eqx.filter_grad(loss))(recomputed))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
    assert "remat" not in str(jax.make_jaxpr(eqx.filter_grad(loss))(plain))
    block = TransformerBlock(8, 2, 16, KEY, remat=remat)
    assert block.remat == remat


def test_stack_refuses_layers_that_are_not_copies():
    with pytest.raises(ValueError, match="at least one layer"):
        Stack([])
    with pytest.raises(ValueError, match="copies of one layer"):
        Stack([TransformerBlock(8, 2, 16, KEY), TransformerBlock(8, 2, 32, KEY)])
    with pytest.raises(TypeError, match="Sequential or a TransformerDecoder"):
        stack_layers(TransformerBlock(8, 2, 16, KEY))


# The attention implementation: one choice per layer, the same function


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"causal": True, "window": 3}])
def test_every_implementation_computes_the_same_attention(options):
    x = jax.random.normal(KEY, (9, 8))
    mask = jnp.arange(9) < 6
    layers = {
        name: MultiHeadSelfAttention(8, 2, KEY, implementation=name, **options)
        for name in ("materialised", "blocked", "xla")
    }
    expected = layers["materialised"](x, mask=mask)
    grad = eqx.filter_grad(lambda m: (m(x, mask=mask) ** 2).sum())
    for name in ("blocked", "xla"):
        np.testing.assert_allclose(layers[name](x, mask=mask), expected, atol=1e-5, err_msg=name)
        leaves_close(grad(layers[name]), grad(layers["materialised"]), atol=1e-5)
    # a padded step's NaN stays hidden; a visible one reaches exactly the rows that see it
    poisoned = x.at[7].set(jnp.nan)
    for name, layer in layers.items():
        hidden = layer(poisoned, mask=mask)
        assert bool(jnp.isfinite(hidden[:6]).all()), name
        seen = layer(x.at[2].set(jnp.nan))
        sees = np.arange(9) >= 2 if options.get("causal") else np.ones(9, bool)
        if "window" in options:
            sees &= np.arange(9) < 2 + 3
        np.testing.assert_array_equal(np.isnan(seen).any(axis=-1), sees, err_msg=name)


def test_xla_cross_attention_gives_zeros_where_nothing_is_visible():
    x = jax.random.normal(KEY, (4, 8))
    context = jax.random.normal(jax.random.fold_in(KEY, 1), (3, 5))
    plain = MultiHeadCrossAttention(8, 2, KEY, 5)
    xla = MultiHeadCrossAttention(8, 2, KEY, 5, implementation="xla")
    for context_mask in (jnp.array([True, False, True]), jnp.zeros(3, bool)):
        np.testing.assert_allclose(
            xla(x, context, context_mask=context_mask),
            plain(x, context, context_mask=context_mask),
            atol=1e-6,
        )
    assert not bool(xla(x, context, context_mask=jnp.zeros(3, bool)).any())


def test_cudnn_needs_a_gpu_but_exports_as_xla(tmp_path):
    x = jax.random.normal(KEY, (5, 8))
    with pytest.raises(ValueError, match=r"needs an NVIDIA GPU.*'cpu' backend"):
        MultiHeadSelfAttention(8, 2, KEY, implementation="cudnn")(x)
    config = ModelConfig("transformer_encoder", {**ARGS, "causal": True, "implementation": "cudnn"})
    model = config.build(KEY)
    export_model(model, config, tmp_path / "art", platforms=["cpu", "cuda"], static_shapes=[])
    artifact = load(tmp_path / "art")
    for name, function in artifact.functions.items():
        text = function.mlir_module()
        assert "cudnn" not in text.lower() and "__cudnn" not in text, name
    assert max(check_golden(artifact).values()) < 1e-5
    xla = ModelConfig("transformer_encoder", {**config.arguments, "implementation": "xla"})
    np.testing.assert_allclose(
        artifact.forward(np.ones((1, 4, 3), np.float32)),
        jax.vmap(xla.build(KEY))(np.ones((1, 4, 3), np.float32)),
        atol=1e-5,
    )


def test_memory_efficient_is_the_older_spelling_of_implementation():
    assert MultiHeadSelfAttention(8, 2, KEY, memory_efficient=True).implementation == "blocked"
    assert MultiHeadSelfAttention(8, 2, KEY, memory_efficient=False).implementation == (
        "materialised"
    )
    assert MultiHeadSelfAttention(8, 2, KEY).implementation == "auto"
    assert MultiHeadSelfAttention(8, 2, KEY, implementation="xla").memory_efficient is False
    with pytest.raises(ValueError, match=r"means `implementation='blocked'`.*Pass one of them"):
        MultiHeadSelfAttention(8, 2, KEY, memory_efficient=True, implementation="xla")
