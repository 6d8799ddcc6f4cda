"""`TransformerLM`'s construction: its own arguments checked, its blocks (attention or a
recurrent mixer, each with its options), the parts around them, and all of them stored in their
precision."""

from collections.abc import Mapping, Sequence
from typing import Any

from jaxtyping import PRNGKeyArray

from .. import precision
from ..blocks.mixer_block import make_norm
from ..blocks.recurrent_block import RecurrentBlock
from ..blocks.transformer_block import TransformerBlock
from ..core import require_bool, require_choice, require_key, require_positive
from ..layers.language import Embedding, LMHead
from ..layers.positions import LearnedPositions
from .language_options import mixer_kinds

__all__ = ["LM_POSITIONS", "check_arguments", "lm_blocks", "lm_parts", "stored"]

LM_POSITIONS = ("rope", "learned")


def check_arguments(
    key: Any,
    vocab: int,
    d_model: int,
    depth: int,
    max_len: int,
    positions: str,
    tie_embeddings: bool,
    scan_layers: bool,
    embed_scale: bool,
    param_dtype: str,
    compute_dtype: str | None,
    quantize: str | None,
    quantize_embeddings: bool,
) -> None:
    """`TransformerLM`'s own arguments (the blocks check theirs): sizes, flags, the positions,
    dtypes and a quantization it knows, consistent."""
    require_key(key)
    require_positive(vocab=vocab, d_model=d_model, depth=depth, max_len=max_len)
    require_bool(tie_embeddings=tie_embeddings, scan_layers=scan_layers, embed_scale=embed_scale)
    require_choice("positions", positions, LM_POSITIONS)
    require_choice("param_dtype", param_dtype, precision.PARAM_DTYPES)
    if compute_dtype is not None:
        require_choice("compute_dtype", compute_dtype, precision.PARAM_DTYPES)
    if quantize is not None:
        require_choice("quantize", quantize, precision.QUANTIZE)
    require_bool(quantize_embeddings=quantize_embeddings)
    if quantize_embeddings and quantize is None:
        raise ValueError(
            "`quantize_embeddings=True` quantizes the tables along with the projections: "
            'pass `quantize="int8"` too.'
        )


def lm_blocks(
    d_model: int,
    n_heads: int,
    d_ff: int,
    keys: Sequence[PRNGKeyArray],
    block: Mapping[str, Any],
    options: Mapping[str, Any],
    per_layer: Sequence[Mapping[str, Any]],
    mixers: Sequence[str] | None,
    mixer_options: Mapping[str, Mapping[str, Any]] | None,
) -> tuple[TransformerBlock | RecurrentBlock, ...]:
    """`TransformerLM`'s blocks, one per kind: attention with the model's options and its layer's
    own (Gemma's alternating windows, ...), or a recurrent mixer with its options."""
    kinds = mixer_kinds(mixers, mixer_options, len(keys), per_layer)
    recurrent = {key: value for key, value in block.items() if key != "causal"}
    return tuple(
        TransformerBlock(d_model, n_heads, d_ff, k, **block, **{**options, **layer})
        if kind == "attention"
        else RecurrentBlock(
            d_model, d_ff, k, kind, **recurrent, **dict((mixer_options or {}).get(kind, {}))
        )
        for k, layer, kind in zip(keys, per_layer, kinds, strict=True)
    )


def stored(
    parts: dict[str, Any], param_dtype: str, quantize: str | None, quantize_embeddings: bool
) -> dict[str, Any]:
    """The model's fields as stored: quantized (the projections, and the tables with
    `quantize_embeddings`), the rest in `param_dtype`."""
    if quantize is not None:
        parts = precision.quantize(parts, quantize_embeddings)
    return precision.cast(parts, param_dtype)


def lm_parts(
    vocab: int,
    d_model: int,
    max_len: int,
    keys: tuple[PRNGKeyArray, PRNGKeyArray, PRNGKeyArray],
    positions: str,
    norm: str,
    eps: float,
    tie_embeddings: bool,
    on_invalid: str,
    blocks: Any,
) -> dict[str, Any]:
    """`TransformerLM`'s fields of arrays around its blocks: the table, GPT-2's learned positions
    (None where they are rotary), the final norm and an untied head (None where tied)."""
    embed_key, position_key, head_key = keys
    learned = positions == "learned"
    return dict(
        embed=Embedding(vocab, d_model, embed_key, on_invalid=on_invalid),
        positions=LearnedPositions(max_len, d_model, position_key) if learned else None,
        blocks=blocks,
        norm=make_norm(norm, d_model, eps),  # `norm` was checked by the blocks
        head=None if tie_embeddings else LMHead(d_model, vocab, head_key),
    )
