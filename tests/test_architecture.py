"""The package's architecture: the import contracts hold (no cycle, no upward import), and the
attention options are said once, in the attention layers' constructors, and reach every attention
through the blocks and factories without either naming them."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from dense_armor.nn.mixers.options import ATTENTION_OPTIONS, options_of
from dense_armor.utility.neural import (
    MultiHeadCrossAttention,
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
}


def reached(layer, field, expected):
    value = getattr(layer, field)
    return value is not None if expected == "a bias" else value == expected


def test_the_attention_options_are_the_self_attentions_keywords():
    assert set(ATTENTION_OPTIONS) == set(SAMPLES)
    assert "causal" not in ATTENTION_OPTIONS  # blocks and factories take it themselves
    cross = set(options_of(MultiHeadCrossAttention)) - {"d_context"}
    assert cross < set(ATTENTION_OPTIONS)


def attentions(option, value):
    """Every attention layer that `option=value` reaches, built by each block and factory."""
    options = {option: value, "causal": True} if option == "window" else {option: value}
    encoder = transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 8, **options)
    decoder = transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 8, **{option: value})
    block = TransformerBlock(8, 2, 16, KEY, **options)
    decoder_block = TransformerDecoderBlock(8, 2, 16, KEY, **{option: value})
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
    assert "Contracts: 4 kept, 0 broken." in result.stdout
