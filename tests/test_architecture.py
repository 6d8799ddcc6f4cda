"""The package's architecture: the import contracts hold (no cycle, no upward import); the
attention options are said once, in the attention layers' constructors, and reach every attention
through the blocks and factories without either naming them; one visibility rule, one cache
protocol, a loss that knows its checks, and a family registry the export stage asks."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.checkpoints import FAMILIES
from dense_armor.nn.core import sees
from dense_armor.nn.mixers.options import ATTENTION_OPTIONS, options_of
from dense_armor.nn.state.cache import KeyValueCache
from dense_armor.training import Loss, as_loss, cross_entropy_loss, evaluate
from dense_armor.utility.neural import (
    MultiHeadCrossAttention,
    MultiHeadSelfAttention,
    TransformerBlock,
    TransformerDecoderBlock,
    transformer_decoder,
    transformer_encoder,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = jax.random.PRNGKey(0)

# A value other than the default for every attention option, and the field it must reach. An
# option added to MultiHeadSelfAttention fails here until it has a row: nothing else to change.
SAMPLES = {
    "window": (3, "window", 3),
    "memory_efficient": (True, "implementation", "blocked"),
    "implementation": ("xla", "implementation", "xla"),
    "n_kv_heads": (1, "n_kv_heads", 1),
    "rope_base": (500.0, "rope_base", 500.0),
    "use_bias": (True, "b_Q", "a bias"),
    "attention_dropout": (0.25, "attention_dropout", 0.25),
    "head_dim": (6, "head_dim", 6),
    "rope_scaling": (
        {"rope_type": "linear", "factor": 2.0},
        "rope_scaling",
        (("factor", 2.0), ("rope_type", "linear")),
    ),
    "rotary_fraction": (0.5, "rotary_fraction", 0.5),
    "qk_norm": ("projection", "q_norm.d_model", 8),
    # options of the q/k norm: they reach it with `qk_norm` set beside them
    "qk_norm_eps": ({"qk_norm": "head", "qk_norm_eps": 1e-5}, "k_norm.eps", 1e-5),
    "qk_norm_plus_one": ({"qk_norm": "head", "qk_norm_plus_one": True}, "q_norm.plus_one", True),
    "query_scale": (0.5, "query_scale", 0.5),
    "logit_softcap": (20.0, "logit_softcap", 20.0),
    "output_gate": (True, "W_G", "a bias"),  # present: "a bias" reads "not None"
}


def reached(layer, field, expected):
    value = layer
    for part in field.split("."):
        value = getattr(value, part)
    return value is not None if expected == "a bias" else value == expected


def test_the_attention_options_are_the_self_attentions_keywords():
    assert set(ATTENTION_OPTIONS) == set(SAMPLES)
    assert "causal" not in ATTENTION_OPTIONS  # blocks and factories take it themselves
    cross = set(options_of(MultiHeadCrossAttention)) - {"d_context"}
    assert cross < set(ATTENTION_OPTIONS)


def attentions(option, value):
    """Every attention layer that `option=value` reaches, built by each block and factory."""
    given = value if option.startswith("qk_norm_") else {option: value}
    options = {**given, "causal": True} if option == "window" else given
    encoder = transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 8, **options)
    decoder = transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 8, **given)
    block = TransformerBlock(8, 2, 16, KEY, **options)
    decoder_block = TransformerDecoderBlock(8, 2, 16, KEY, **given)
    found = {
        "TransformerBlock": block.attention,
        "TransformerDecoderBlock": decoder_block.self_attention,
        "transformer_encoder": encoder.layers[2].attention,
        "transformer_decoder": decoder.blocks[0].self_attention,
    }
    if option in options_of(MultiHeadCrossAttention):
        found["TransformerDecoderBlock (cross)"] = decoder_block.cross_attention
        found["transformer_decoder (cross)"] = decoder.blocks[0].cross_attention
    return found


@pytest.mark.parametrize("option", sorted(SAMPLES))
def test_every_attention_option_reaches_every_attention(option):
    value, field, expected = SAMPLES[option]
    if option == "rope_base":  # a factory's rotary base applies with positions="rope"
        encoder = transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 8, positions="rope", rope_base=500.0)
        assert encoder.layers[1].attention.rope_base == 500.0
        assert TransformerBlock(8, 2, 16, KEY, rope_base=value).attention.rope_base == value
        return
    for owner, layer in attentions(option, value).items():
        assert reached(layer, field, expected), (owner, getattr(layer, field))


@pytest.mark.parametrize(
    "build",
    [
        lambda: TransformerBlock(8, 2, 16, KEY, windw=3),
        lambda: TransformerDecoderBlock(8, 2, 16, KEY, windw=3),
        lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 8, windw=3),
        lambda: transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 8, windw=3),
    ],
    ids=[
        "TransformerBlock",
        "TransformerDecoderBlock",
        "transformer_encoder",
        "transformer_decoder",
    ],
)
def test_an_unknown_option_is_refused_naming_the_known_ones(build, request):
    owner = request.node.callspec.id
    with pytest.raises(
        TypeError, match=rf"{owner} got unexpected keyword arguments \['windw'\].*'window'"
    ):
        build()


def test_the_import_contracts_hold():
    """pyproject's `[tool.importlinter]` contracts, as `nox -s lint` checks them: the package's
    layers import only downwards, and the faces in `dense_armor.utility` only from `nn`."""
    lint_imports = pathlib.Path(sys.executable).parent / "lint-imports"  # the test extra's
    result = subprocess.run(
        [str(lint_imports), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 7 kept, 0 broken." in result.stdout


def test_one_visibility_rule_for_every_causal_mask():
    """`sees`, by hand: step t sees keys s <= t, and with a window of 2 only s in (t - 2, t]."""
    q, k = jnp.arange(4)[:, None], jnp.arange(4)[None, :]
    causal = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    windowed = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    np.testing.assert_array_equal(sees(q, k), np.array(causal, bool))
    np.testing.assert_array_equal(sees(q, k, 2), np.array(windowed, bool))
    # the attention's own mask of a windowed layer is that rule: weights zero where it is false
    m = MultiHeadSelfAttention(8, 2, KEY, causal=True, window=2)
    weights = m.attention_weights(jax.random.normal(KEY, (4, 8)))
    np.testing.assert_array_equal(np.asarray(weights[0] > 0), np.array(windowed, bool))


def test_every_key_value_cache_answers_the_one_protocol():
    m = MultiHeadSelfAttention(8, 2, KEY, causal=True)
    caches = [
        m.init_cache(),
        m.init_cache(4),
        MultiHeadSelfAttention(8, 2, KEY, causal=True, window=2).init_cache(),
    ]
    assert [isinstance(c, KeyValueCache) for c in caches] == [True, True, True]
    assert [c.fixed_shape for c in caches] == [False, True, True]
    keys, values = caches[0]  # the page's growing cache: two (0, d_model) arrays
    assert keys.shape == values.shape == (0, 8)
    with pytest.raises(TypeError):
        KeyValueCache()  # abstract: update and guard are each cache's own


def test_a_loss_is_an_object_that_knows_its_checks_and_metrics():
    def squared(model, xs, labels, key=None):
        return jnp.mean((jax.vmap(model)(xs)[:, 0] - labels) ** 2)

    assert as_loss(squared) == as_loss(squared) and hash(as_loss(squared)) == hash(Loss(squared))
    assert as_loss(cross_entropy_loss) is cross_entropy_loss
    model = transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6)
    xs = jax.random.normal(KEY, (5, 4, 3))
    labels = jnp.array([0, 1, 1, 0, 1])
    assert set(evaluate(model, xs, labels)) == {"loss", "accuracy"}
    assert set(evaluate(model, xs, labels.astype(jnp.float32), loss_fn=squared)) == {"loss"}
    with pytest.raises(ValueError, match=r"`labels` must lie in \[0, 2\)"):
        cross_entropy_loss.check_data("evaluate", model, xs, labels + 1)
    as_loss(squared).check_data("evaluate", model, xs, labels + 1)  # other targets: no check


@pytest.mark.parametrize(
    "arguments, end",
    [
        ({}, 6),  # sinusoidal positions: a table of max_len rows
        ({"positions": "learned"}, 6),
        ({"positions": "rope"}, None),
        ({"positions": "none"}, None),
        ({"causal": True, "window": 3}, None),  # a window's sinusoids never end
        ({"causal": True, "window": 3, "positions": "learned"}, 6),  # a table still does
    ],
)
def test_the_family_registry_says_where_a_models_positions_end(arguments, end):
    family = FAMILIES["transformer_encoder"]
    full = {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "n_out": 2, "max_len": 6}
    full.update(arguments)
    assert family.input_spec(full) == ("float32", (3,)) and family.max_length(full) == 6
    assert family.vocabulary(full) is None
    assert family.positions_end(full) == end


@pytest.mark.parametrize("arguments, end", [({}, None), ({"positions": "learned"}, 16)])
def test_a_language_models_inputs_are_token_ids_and_its_positions_default_to_rotary(arguments, end):
    family = FAMILIES["transformer_lm"]
    full = {"vocab": 50, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "max_len": 16}
    full.update(arguments)
    assert family.input_spec(full) == ("int32", ()) and family.vocabulary(full) == 50
    assert family.positions_end(full) == end
