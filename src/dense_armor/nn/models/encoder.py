"""The encoder factory, `transformer_encoder`: a `Sequential` of an input projection, positions,
blocks (attention, recurrent or both) and a pooled output; and `attention_maps`."""

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
    MeanOverTime(d_model), Dense(d_model, n_out))`.

    **Arguments:** in order `n_in`, `d_model`, `n_heads`, `d_ff`, `depth`, `n_out`, `key`,
    `max_len`; then `causal=False` (makes every block causal, so the encoder streams),
    `dropout=0.0` (of every block) and `positions`: `"sinusoidal"` (`AddPositions(max_len)`, no
    parameters), `"learned"` (`LearnedPositions(max_len, d_model, key)`) or `"rope"` (rotary
    positions inside every attention, no positional layer and no bound at `max_len`; their base
    is `rope_base=10000.0`; or `"none"`, no positions at all), and `gate=False`
    (a `Gate` in place of every residual addition), `norm_first=False` (pre-LN blocks, followed by
    a final `LayerNorm` before the mean), `compute_dtype=None` (e.g. `"bfloat16"`: a `Cast` in
    front runs the model in that dtype, parameters stay float32), `scan_layers=False` (the
    blocks in one `Stack`: their parameters stacked on a leading depth axis and applied by one
    `jax.lax.scan`, so the block compiles once whatever the depth; the same outputs as the
    unrolled model with the same weights) and `remat=None` (`"block"` or `"attention"`:
    recompute those activations in the backward pass; see `TransformerBlock`), the options of
    PyTorch's `nn.TransformerEncoderLayer` `activation="relu"` (or `"gelu"`) and
    `layer_norm_eps=1e-5` (every LayerNorm's), and `mixers="attention"`: what mixes the steps
    in each block, one of `"attention"` (a `TransformerBlock`), `"gru"`, `"lstm"` or `"mingru"`
    (a `RecurrentBlock` around that recurrent layer, with the same residuals, LayerNorms and
    feed-forward), for every block or as a sequence of `depth` names, one per block (a mixed
    stack, e.g. `("mingru", "attention")`). A stack of recurrent blocks is causal whatever
    `causal` says; `positions="none"` leaves out the positional layer (a recurrent block knows
    the order of the steps), and such a model streams without end in constant memory.

    Every other keyword is an option of every attention (`**attention`; see `TransformerBlock`
    and `MultiHeadSelfAttention`): `window=None` (sliding-window attention in every block; needs
    `causal=True`; the sinusoidal positions are then unbounded, so the encoder streams forever),
    `implementation=None` and its older spelling `memory_efficient=None` (blocked attention from
    `BLOCKED_MIN_LENGTH` steps on, or always, or never), `n_kv_heads=None` (grouped-query
    attention: `n_kv_heads` key/value heads, each shared by `n_heads / n_kv_heads` query heads;
    1 is multi-query; the caches hold only the key/value heads), `use_bias=False` (attention
    projection biases) and `attention_dropout=0.0` (on the attention weights, in training).

    `forward(x, mask=None)`, `mask` the padding mask of `Layer`.
    """
    require_key(key)
    require_positive(
        n_in=n_in, d_model=d_model, d_ff=d_ff, depth=depth, n_out=n_out, max_len=max_len
    )
    require_bool(scan_layers=scan_layers)
    options = attention_options("transformer_encoder", attention)
    options["rope_base"] = _rope_base(positions, rope_base)
    in_key, pos_key, out_key, *block_keys = jr.split(key, 3 + depth)
    common: dict[str, Any] = dict(  # what every block takes
        dropout=dropout,
        gate=gate,
        norm_first=norm_first,
        remat=remat,
        activation=activation,
        layer_norm_eps=layer_norm_eps,
    )
    blocks = [
        RecurrentBlock(d_model, d_ff, k, kind, **common)
        if kind != "attention"
        else TransformerBlock(
            d_model,
            n_heads,
            d_ff,
            k,
            causal=causal,
            **common,
            **options,
        )
        for kind, k in zip(_mixers(mixers, depth, scan_layers), block_keys, strict=True)
    ]
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
