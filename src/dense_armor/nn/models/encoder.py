"""The encoder factory, `transformer_encoder`: a `Sequential` of an input projection, positions,
blocks (attention, recurrent or both) and a pooled output; and `attention_maps`.

`transformer_encoder`'s options: `causal=False` (every block causal, so the encoder streams),
`positions` (`"sinusoidal"`: `AddPositions(max_len)`; `"learned"`: `LearnedPositions`; `"rope"`:
rotary positions inside every attention, base `rope_base`, no bound at `max_len`; `"none"`),
`compute_dtype=None` (e.g. `"bfloat16"`: a `Cast` in front, parameters stay float32),
`scan_layers=False` (the blocks in one `Stack`, applied by one `jax.lax.scan`: the block compiles
once whatever the depth, the same outputs as unrolled), and `mixers="attention"`: what mixes the
steps in each block, `"attention"` (a `TransformerBlock`), `"gru"`, `"lstm"` or `"mingru"` (a
`RecurrentBlock`), for every block or one name per block (a mixed stack, e.g.
`("mingru", "attention")`; a recurrent stack is causal whatever `causal` says, and with
`positions="none"` streams without end in constant memory). Every block takes `dropout`, `gate`
(a `Gate` for every residual addition), `norm_first` (pre-LN blocks and a final `LayerNorm`),
`remat`, `activation` (PyTorch's `"relu"` or `"gelu"`) and `layer_norm_eps` (see
`TransformerBlock`); every other keyword is an option of every attention (`**attention`, see
`MultiHeadSelfAttention`): `window` (needs `causal=True`; the encoder then streams forever),
`implementation`, `n_kv_heads` (grouped-query attention), `use_bias`, `attention_dropout`.
"""

from collections.abc import Sequence
from typing import Any

import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..blocks.recurrent_block import RecurrentBlock
from ..blocks.transformer_block import TransformerBlock
from ..core import require_bool, require_key, require_positive
from ..layers.basic import Cast, Dense, LayerNorm, MeanOverTime
from ..mixers.options import attention_options
from .inputs import _positions, _rope_base
from .sequential import Sequential, _apply
from .stack import Stack, unstack_layers

__all__ = ["attention_maps", "transformer_encoder"]


MIXERS = ("attention", "gru", "lstm", "mingru")


def _mixers(mixers: str | Sequence[str], depth: int, scan_layers: bool) -> list[str]:
    """One mixer name per block, from `mixers`: one name for every block, or one per block."""
    many = isinstance(mixers, Sequence) and not isinstance(mixers, str)
    kinds: list[Any] = list(mixers) if many else [mixers] * depth
    if len(kinds) != depth or any(kind not in MIXERS for kind in kinds):
        raise ValueError(
            f"`mixers` must be one of {MIXERS}, or a sequence of {depth} of them (one per block, "
            f"`depth={depth}`); received `mixers={mixers!r}`."
        )
    if scan_layers and len(set(kinds)) > 1:
        raise ValueError(
            f"`scan_layers=True` stacks copies of one block; `mixers={mixers!r}` mixes blocks of "
            "different kinds. Use `scan_layers=False` for a mixed stack."
        )
    return kinds


def transformer_encoder(
    n_in: int,
    d_model: int,
    n_heads: int,
    d_ff: int,
    depth: int,
    n_out: int,
    key: PRNGKeyArray,
    max_len: int,
    causal: bool = False,
    dropout: float = 0.0,
    positions: str = "sinusoidal",
    gate: bool = False,
    norm_first: bool = False,
    compute_dtype: str | None = None,
    scan_layers: bool = False,
    remat: str | None = None,
    rope_base: float = 10000.0,
    activation: str = "relu",
    layer_norm_eps: float = 1e-5,
    mixers: str | Sequence[str] = "attention",
    **attention: Any,
) -> Sequential:
    """A sequence-to-vector encoder: `(T, n_in) -> (n_out,)`.

    `Sequential(Dense(n_in, d_model), positions, depth x TransformerBlock(d_model, n_heads, d_ff),
    MeanOverTime(d_model), Dense(d_model, n_out))`; `forward(x, mask=None)`, `mask` the padding
    mask of `Layer`. **Arguments:** in order `n_in`, `d_model`, `n_heads`, `d_ff`, `depth`,
    `n_out`, `key`, `max_len`; then the options of this module's docstring (`causal`,
    `positions`, `compute_dtype`, `scan_layers`, `mixers`), the blocks' (`dropout`, `gate`,
    `norm_first`, `remat`, `activation`, `layer_norm_eps`) and the attention's (`**attention`).
    """
    require_key(key)
    require_positive(n_in=n_in, d_model=d_model, d_ff=d_ff, depth=depth, n_out=n_out,
                     max_len=max_len)  # fmt: skip
    require_bool(scan_layers=scan_layers)
    options = attention_options("transformer_encoder", attention)
    options["rope_base"] = _rope_base(positions, rope_base)
    in_key, pos_key, out_key, *block_keys = jr.split(key, 3 + depth)
    common: dict[str, Any] = dict(  # what every block takes
        dropout=dropout, gate=gate, norm_first=norm_first, remat=remat, activation=activation,
        layer_norm_eps=layer_norm_eps,
    )  # fmt: skip
    kinds = _mixers(mixers, depth, scan_layers)
    blocks = _blocks(d_model, n_heads, d_ff, block_keys, kinds, causal, common, options)
    position_layer = _positions(positions, max_len, d_model, pos_key, attention.get("window"))
    return Sequential(
        *([Cast(compute_dtype)] if compute_dtype is not None else []),
        Dense(n_in, d_model, in_key),
        *([position_layer] if position_layer is not None else []),
        *([Stack(blocks)] if scan_layers else blocks),
        *([LayerNorm(d_model, layer_norm_eps)] if norm_first else []),
        MeanOverTime(d_model),
        Dense(d_model, n_out, out_key),
    )


def _blocks(
    d_model: int,
    n_heads: int,
    d_ff: int,
    keys: Sequence[PRNGKeyArray],
    kinds: Sequence[str],
    causal: bool,
    common: dict[str, Any],
    options: dict[str, Any],
) -> list[TransformerBlock | RecurrentBlock]:
    """The encoder's blocks, one per mixer name: a `TransformerBlock` with the attention's
    options, or a `RecurrentBlock` around that recurrent layer; the same residuals, norms and
    feed-forward in both."""
    return [
        TransformerBlock(d_model, n_heads, d_ff, k, causal=causal, **common, **options)
        if kind == "attention"
        else RecurrentBlock(d_model, d_ff, k, kind, **common)
        for kind, k in zip(kinds, keys, strict=True)
    ]


def attention_maps(
    model: Sequential, x: Array, *, mask: Array | None = None
) -> list[Float[Array, "n_heads T T"]]:
    """The attention weights of every `TransformerBlock` of `model` on the input `x`, in order:
    one `(n_heads, T, T)` array per block, each computed on what that block receives."""
    maps = []
    for layer in unstack_layers(model).layers:
        if isinstance(layer, TransformerBlock):
            maps.append(layer.attention_weights(x, mask=mask))
        x = _apply(layer, x, mask, None)
    if not maps:
        raise ValueError("attention_maps: the model has no TransformerBlock.")
    return maps


# The decoder model and its factory live in `decoder`; their names are the models' too.
