"""Attention (Vaswani et al. 2017, "Attention Is All You Need"): what the attention layers share,
projecting, splitting into heads, attending with the materialised scores (`materialised`, whose
`scaled_dot_product_attention` and `attention_weights` are re-exported here) or in blocks
(`blocked`).

The layers live in `self_attention` and `cross_attention`, the blocks in `blocks`, the positional
encodings in `positions`; every name the attention page imports from this module
(`MultiHeadSelfAttention`, `TransformerBlock`, `sinusoidal_positions`, ...) is re-exported here.

A layer's `mask` is described once, in `core.Layer`; only the kernels take a mask over the
scores, `(..., T, S)`, as the attention page defines it.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .blocked import blocked_attention, use_blocked
from .core import (
    CannotStream,
    Param,
    require_bool,
    require_positive,
)
from .kernels import _dot_product_attention
from .materialised import _attention, attention_weights, scaled_dot_product_attention
from .rotary import rotate

__all__ = [
    "ContextCache",
    "DecoderCache",
    "Gate",
    "MultiHeadCrossAttention",
    "MultiHeadSelfAttention",
    "TransformerBlock",
    "TransformerDecoderBlock",
    "attention_weights",
    "scaled_dot_product_attention",
    "sinusoidal_encoding",
    "sinusoidal_positions",
]


def _check_heads(d_model: int, n_heads: int, n_kv_heads: int | None = None) -> int:
    """Check the head counts; return `n_kv_heads` (default `n_heads`)."""
    require_positive(d_model=d_model, n_heads=n_heads)
    if d_model % n_heads:
        raise ValueError(
            f"`d_model` must be divisible by `n_heads`; received `d_model={d_model}`, "
            f"`n_heads={n_heads}` (remainder {d_model % n_heads})."
        )
    if n_kv_heads is None:
        return n_heads
    require_positive(n_kv_heads=n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(
            f"`n_heads` must be a multiple of `n_kv_heads` (each key/value head serves a group "
            f"of query heads); received `n_heads={n_heads}`, `n_kv_heads={n_kv_heads}`."
        )
    return int(n_kv_heads)


# How tensor parallelism splits an attention layer (`Layer.tensor_parallel`): the query, key and
# value projections (and their biases) by output columns, whole heads per device; the output
# projection by rows, so each device's heads give a partial sum of the output.
HEAD_SPLIT: dict[str, tuple[int, str | None]] = {
    "W_Q": (-1, "n_heads"),
    "b_Q": (-1, "n_heads"),
    "W_K": (-1, "n_kv_heads"),
    "b_K": (-1, "n_kv_heads"),
    "W_V": (-1, "n_kv_heads"),
    "b_V": (-1, "n_kv_heads"),
    "W_O": (-2, "n_heads"),
}


def _rotated(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    q: Array,
    keys: Array,
    positions: tuple[Array, Array] | None,
) -> tuple[Array, Array]:
    """Queries and keys (heads first) rotated by their `(query, key)` positions when the layer
    has rotary positions (`rope_base`); unchanged otherwise. Keys are cached unrotated."""
    base = getattr(layer, "rope_base", None)
    if base is None:
        return q, keys
    if positions is None:  # a whole sequence: step t at position t
        positions = (jnp.arange(q.shape[-2]), jnp.arange(keys.shape[-2]))
    return rotate(q, positions[0], base), rotate(keys, positions[1], base)


def _grouped(q: Array, n_kv_heads: int) -> Array:
    """Query heads `(n_heads, T, d)` as `(n_kv_heads, group, T, d)`: query head `h` attends with
    key/value head `h // group`, and keys `(n_kv_heads, 1, S, d)` broadcast over the group, never
    repeated in memory."""
    return q.reshape(n_kv_heads, q.shape[0] // n_kv_heads, *q.shape[1:])


def _project(x: Array, weight: Param) -> Array:
    """`x @ weight`, in the dtype of `x`."""
    return jnp.einsum("...d,de->...e", x, weight.value.astype(x.dtype))


def _projected(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention", x: Array, which: str
) -> Array:
    """`x W_<which>`, plus the bias `b_<which>` of a layer built with `use_bias=True`."""
    y = _project(x, getattr(layer, f"W_{which}"))
    bias = getattr(layer, f"b_{which}", None)
    return y if bias is None else y + jnp.broadcast_to(bias.value.astype(y.dtype), y.shape)


def _biases(use_bias: bool, widths: dict[str, int]) -> dict[str, Param | None]:
    """The attention's biases: zeros (as PyTorch's `nn.MultiheadAttention` starts them), or
    `None` for every one when `use_bias=False`."""
    require_bool(use_bias=use_bias)
    return {f"b_{k}": Param(jnp.zeros(w)) if use_bias else None for k, w in widths.items()}


def _attend_heads(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    x: Array,
    keys: Array,
    values: Array,
    mask: Array | None,
    positions: tuple[Array, Array] | None = None,
    hidden_zeros: bool = False,
) -> Array:
    """Queries `x W_Q` of `x (T, d_model)`, split into heads, against projected `keys` and
    `values` already in heads `(n_kv_heads, S, d_head)`; attended with
    `scaled_dot_product_attention` (`hidden_zeros`: see `_attention`) and joined by `W_O`."""
    q = _heads(_projected(layer, x, "Q"), layer.n_heads)
    # Cached keys and values may be stored wider than the compute dtype (float32 under bfloat16).
    keys, values = keys.astype(x.dtype), values.astype(x.dtype)
    q, keys = _rotated(layer, q, keys, positions)
    if layer.implementation in ("xla", "cudnn"):  # jax.nn takes fewer key/value heads itself
        out = _dot_product_attention(q, keys, values, mask, layer.implementation)
    elif keys.shape[0] == q.shape[0]:  # a key/value head per query head: no group axis, whose
        # broadcast in the products XLA's CPU compiler runs 2.5x slower
        out = _attention(q, keys, values, mask, hidden_zeros)
    else:  # grouped-query attention: each key/value head's group of query heads folded into
        # its query rows, `(n_kv_heads, group * T, d)`, for plain batched products (a broadcast
        # group axis runs 1.25x slower), the mask tiled over the group to match
        n_kv, group, length = keys.shape[0], q.shape[0] // keys.shape[0], q.shape[1]
        folded = q.reshape(n_kv, group * length, q.shape[2])
        if mask is not None:
            scores = (n_kv, group, length, keys.shape[1])
            mask = jnp.broadcast_to(mask, scores).reshape(n_kv, group * length, keys.shape[1])
        out = _attention(folded, keys, values, mask, hidden_zeros).reshape(q.shape)
    return _join_heads(layer, out)


def _dropped(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    x: Array,
    keys: Array,
    values: Array,
    mask: Array | None,
    key: Array,
) -> Array:
    """Attention with dropout on its weights (PyTorch's `dropout` of `nn.MultiheadAttention`):
    the weights of `x`'s queries against projected `keys` and `values` `(S, n_kv_heads * d_head)`
    are materialised, each dropped with probability `layer.attention_dropout` and the others
    scaled by `1 / (1 - attention_dropout)`."""
    rate = layer.attention_dropout
    q, k = _rotated(
        layer,
        _heads(_projected(layer, x, "Q"), layer.n_heads),
        _heads(keys, layer.n_kv_heads),
        None,
    )
    weights = attention_weights(_grouped(q, layer.n_kv_heads), k[:, None], mask)  # float32
    keep = jax.random.bernoulli(key, 1.0 - rate, weights.shape)
    scale = 0.0 if rate == 1.0 else 1.0 / (1.0 - rate)  # every weight dropped: zeros, not 0/0
    weights = jnp.where(keep, weights * scale, 0.0)
    v = _heads(values, layer.n_kv_heads).astype(jnp.float32)
    out = jnp.einsum("kgts,ksd->kgtd", weights, v).reshape(q.shape).astype(x.dtype)
    return _join_heads(layer, out)


def _join_heads(layer: "MultiHeadSelfAttention | MultiHeadCrossAttention", out: Array) -> Array:
    """Heads `(n_heads, T, d_head)` joined to `(T, d_model)` and projected by `W_O`."""
    joined = out.transpose(1, 0, 2).reshape(out.shape[1], layer.d_model)
    return _projected(layer, joined, "O")


def _sequence_mask(
    queries: int, keys: int, causal: bool, window: int | None, key_mask: Array | None
) -> Array | None:
    """The `(T, S)` mask (or `None`) that `causal`, `window` and `key_mask (S,)` describe."""
    mask = None
    if causal:
        rows, cols = jnp.arange(queries)[:, None], jnp.arange(keys)[None, :]
        mask = cols <= rows
        if window is not None:
            mask = mask & (cols > rows - window)
    if key_mask is not None:
        mask = key_mask[None, :] if mask is None else mask & key_mask[None, :]
    return mask


def _attend_sequence(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    x: Array,
    keys: Array,
    values: Array,
    key_mask: Array | None,
    causal: bool = False,
    window: int | None = None,
) -> Array:
    """Every row of `x (T, d_model)` against projected `keys` and `values` `(S, d_model)`, under
    the mask that `causal`, `window` and `key_mask (S,)` describe: with `blocked_attention` (the
    mask never materialised) or the materialised scores, as `layer.memory_efficient` and the
    lengths decide."""
    length, key_length = x.shape[0], keys.shape[0]
    if not use_blocked(layer.memory_efficient, length, key_length):
        mask = _sequence_mask(length, key_length, causal, window, key_mask)
        return _attend_flat(layer, x, keys, values, mask)
    q = _heads(_projected(layer, x, "Q"), layer.n_heads)
    keys, values = _heads(keys, layer.n_kv_heads), _heads(values, layer.n_kv_heads)
    q, keys = _rotated(layer, q, keys, None)
    keys, values = keys[:, None].astype(x.dtype), values[:, None].astype(x.dtype)
    out = blocked_attention(
        _grouped(q, layer.n_kv_heads), keys, values, causal=causal, window=window, key_mask=key_mask
    )
    return _join_heads(layer, out.reshape(q.shape))


def _attend_flat(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    x: Array,
    keys: Array,
    values: Array,
    mask: Array | None,
) -> Array:
    """`_attend_heads` with keys and values `(S, d_model)`, split into heads first."""
    keys, values = _heads(keys, layer.n_kv_heads), _heads(values, layer.n_kv_heads)
    return _attend_heads(layer, x, keys, values, mask)


def _heads(a: Array, n_heads: int) -> Array:
    """`(L, d_model) -> (n_heads, L, d_model / n_heads)`."""
    return a.reshape(a.shape[0], n_heads, a.shape[1] // n_heads).transpose(1, 0, 2)


def _check_window(window: int | None, causal: bool) -> None:
    if window is None:
        return
    require_positive(window=window)
    if not causal:
        raise ValueError(
            f"`window={window}` restricts each step to the last `window` steps, which needs "
            "`causal=True`."
        )


def _require_causal(layer: "MultiHeadSelfAttention | TransformerBlock") -> None:
    if not layer.causal:
        raise CannotStream(
            f"{type(layer).__name__} was built with `causal=False`: step t of it would see later "
            "steps, so it cannot stream. Build it with `causal=True`."
        )


# The names the attention page imports from this module, defined where their concern lives.
from .blocks import DecoderCache, Gate, TransformerBlock, TransformerDecoderBlock  # noqa: E402
from .cross_attention import ContextCache, MultiHeadCrossAttention  # noqa: E402
from .positions import sinusoidal_encoding, sinusoidal_positions  # noqa: E402
from .self_attention import MultiHeadSelfAttention  # noqa: E402
