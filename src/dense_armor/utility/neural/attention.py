"""Scaled dot-product attention (Vaswani et al. 2017, "Attention Is All You Need"), and what the
attention layers share: projecting, splitting into heads, attending with the materialised scores
or in blocks.

The layers live in `self_attention` and `cross_attention`, the blocks in `blocks`, the positional
encodings in `positions`; every name the attention page imports from this module
(`MultiHeadSelfAttention`, `TransformerBlock`, `sinusoidal_positions`, ...) is re-exported here.

A layer's `mask` is described once, in `core.Layer`; only the functions here take a mask over
the scores, `(..., T, S)`, as the attention page defines it.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .blocked import blocked_attention, use_blocked
from .core import (
    CannotStream,
    Param,
    ShapeError,
    require_bool,
    require_positive,
    type_checked,
)
from .kernels import _dot_product_attention
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


def _masked_scores(q: Array, k: Array, mask: Array | None) -> tuple[Array, Array | None]:
    """The scores `q k^T / sqrt(d_k)` in float32, `-inf` where `mask` hides a key, and the mask
    broadcast to them (or `None`).

    The queries are scaled, not the scores (as Equinox, Flax and PyTorch do): a pass over
    `(T, d_k)` instead of `(T, S)`, where XLA's CPU compiler would feed the fused softmax a
    materialised `(..., T, S)` array of the constant. Exact for a power-of-two `d_k`."""
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    scores = jnp.einsum("...td,...sd->...ts", q, k, preferred_element_type=jnp.float32)
    if mask is None:
        return scores, None
    mask = _broadcast_mask(mask, q, k)
    return jnp.where(mask, scores, -jnp.inf), mask


def attention_weights(
    q: Float[Array, "*#batch T d_k"],
    k: Float[Array, "*#batch S d_k"],
    mask: Bool[Array, "..."] | None = None,
) -> Float[Array, "*#batch T S"]:
    """The weights `softmax(q k^T / sqrt(d_k))` of `scaled_dot_product_attention`, in float32.

    Same arguments as `scaled_dot_product_attention`; every row sums to 1, or is all zeros where
    the mask hides every key.
    """
    scores, mask = _masked_scores(q, k, mask)
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    # A row that sees no key would be all -inf, and its softmax NaN: its scores are replaced by
    # zeros before the softmax and its weights by zeros after, so its output is 0 and no NaN
    # reaches the gradient.
    seen = mask.any(axis=-1, keepdims=True)
    weights = jax.nn.softmax(jnp.where(seen, scores, 0.0), axis=-1)
    return jnp.where(seen, weights, 0.0)


@type_checked
def scaled_dot_product_attention(
    q: Float[Array, "*#batch T d_k"],
    k: Float[Array, "*#batch S d_k"],
    v: Float[Array, "*#batch S d_v"],
    mask: Bool[Array, "..."] | None = None,
) -> Float[Array, "*#batch T d_v"]:
    """`softmax(q k^T / sqrt(d_k)) v` (Vaswani et al. 2017, Eq.(1), page 4).

    **Arguments:**

    - `q`: queries, `(..., T, d_k)`; `k`: keys, `(..., S, d_k)`; `v`: values, `(..., S, d_v)`.
      Leading (head, batch) axes broadcast against each other.
    - `mask`: optional boolean array broadcastable to the scores `(..., T, S)`; `True` where a
      query may look at a key. Masked scores are set to `-inf` before the softmax.

    **Returns:** `(..., T, d_v)`, in the dtype of `v`. The softmax runs in float32 whatever the
    input dtype. A query whose every key is masked gets zeros (never NaN), in the output and in the
    gradient. A masked key contributes nothing, its value included: a NaN or infinite value that a
    query may not see leaves that query's output as it would be without it, and a query that sees
    one gets NaN in its whole row.

    The softmax is normalised after the product with the values, as flash attention does:
    `(exp(s - max s) v) / sum exp(s - max s)`, one division per `(T, d_v)` output instead of
    one per `(T, S)` weight, equal to the softmax's weights times `v` to float32 round-off.
    """
    return _attention(q, k, v, mask)


def _attention(
    q: Array, k: Array, v: Array, mask: Array | None, hidden_zeros: bool = False
) -> Array:
    """`scaled_dot_product_attention`, unchecked. `hidden_zeros=True` (a cache's promise, see
    `KVUpdate`): every value `mask` hides is zero, so none needs zeroing; a row whose output is
    not finite is then made NaN whole, which is the same rule at a pass over `(T, d_v)` instead
    of two over the values and the `(T, S)` mask (half a cached step's time)."""
    if mask is None or hidden_zeros:
        # every value a query may weigh is one it sees: one non-finite value makes its row NaN
        if mask is not None:
            mask = _broadcast_mask(mask, q, k)
        out = _attend(*_common_batch(q, k, v), mask)
        if mask is None:  # every row sees every value: read them alone, no pass over (T, S)
            bad = ~jnp.isfinite(v).all(axis=(-2, -1))
            bad = jnp.broadcast_to(bad[..., None, None], out.shape)
        else:
            bad = jnp.broadcast_to(~jnp.isfinite(out).all(axis=-1, keepdims=True), out.shape)
        return jnp.where(bad, jnp.nan, out).astype(v.dtype)
    # A masked weight is exactly 0, but 0 * NaN is NaN: zero the non-finite values, then mark the
    # queries that may see one (the same rule as blocked_attention's).
    finite = jnp.isfinite(v).all(axis=-1)
    clean = jnp.where(finite[..., None], v, jnp.zeros((), v.dtype))
    q, k, clean = _common_batch(q, k, clean)
    mask = _broadcast_mask(mask, q, k)
    out = _attend(q, k, clean, mask)
    bad = jnp.broadcast_to(jnp.expand_dims(~finite, -2), mask.shape) & mask
    return jnp.where(bad.any(axis=-1)[..., None], jnp.nan, out).astype(v.dtype)


def _broadcast_mask(mask: Array, q: Array, k: Array) -> Array:
    """`mask` broadcast to the scores `(..., T, S)` of `q` and `k`, or a `ShapeError`."""
    lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    scores = (*lead, q.shape[-2], k.shape[-2])
    try:
        return jnp.broadcast_to(mask, scores)
    except ValueError:
        raise ShapeError(
            f"scaled_dot_product_attention: received `mask.shape={mask.shape}`; expected a "
            f"shape that broadcasts to the scores' `(..., T, S)={scores}`."
        ) from None


def _common_batch(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
    """`q`, `k`, `v` with their leading axes broadcast to one shape (the gradient of a broadcast
    axis is then summed by `broadcast_to`'s own derivative, outside `_attend`)."""
    lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return tuple(jnp.broadcast_to(a, (*lead, *a.shape[-2:])) for a in (q, k, v))  # type: ignore


def _transposed_product(a: Array, b: Array) -> Array:
    """`a^T b` over the last two axes, `(..., T, m), (..., T, n) -> (..., m, n)`, computed as
    `(a^T)` materialised times `b`: XLA's CPU compiler runs a product that contracts the leading
    axis of both operands without its fast library, 3x slower, and `a` is the small operand.
    Optimisation barriers keep XLA from folding either transpose back into the product."""
    at = jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2))
    product = jnp.einsum("...mt,...tn->...mn", at, b, preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(product)  # else a transpose after it folds in again


def _attend_parts(q: Array, k: Array, v: Array, mask: Array | None) -> tuple[Array, Array, Array]:
    """`(out, p, total)`: `p = exp(s - max s)` of the masked scores `s` (float32), its row sums
    (1 for a row that sees nothing, whose `p` is all zeros) and `out = (p v) / total`."""
    scores, _ = _masked_scores(q, k, mask)
    if scores.shape[-1] == 0:  # no key at all: every row's output is 0
        p = jnp.zeros(scores.shape)
        return jnp.zeros((*scores.shape[:-1], v.shape[-1])), p, jnp.ones((*scores.shape[:-1], 1))
    # The shift cancels out of the result. A row whose every key is masked has max -inf: 0
    # stands in, so exp() gives 0, and its total 1, so its output is 0. (Without a mask every
    # row sees a key; those passes would keep XLA from fusing the scores with the softmax.)
    top = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    if mask is not None:
        top = jnp.where(jnp.isneginf(top), 0.0, top)
    p = jnp.exp(scores - top)
    total = p.sum(axis=-1, keepdims=True)  # at least 1 in a row that sees a key (its max)
    if mask is not None:
        total = jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("...ts,...sd->...td", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / total, p, total


@jax.custom_vjp
def _attend(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
    """`softmax(q k^T / sqrt(d_k)) v` in float32, normalised after the product with the values;
    `q`, `k`, `v` of one leading shape and `mask` (or `None`) already broadcast to the scores.

    Its derivative is written out (flash attention's, from the saved `exp(s - max s)`): autodiff
    of these equations runs two of its four products as ones XLA's CPU compiler leaves to its
    slow path (see `_transposed_product`)."""
    return _attend_parts(q, k, v, mask)[0]


def _attend_forward(q: Array, k: Array, v: Array, mask: Array | None) -> tuple[Array, tuple]:
    out, p, total = _attend_parts(q, k, v, mask)
    return out, (q, k, v, p, total, out)


def _attend_backward(residuals: tuple, g: Array) -> tuple[Array, Array, Array, None]:
    q, k, v, p, total, out = residuals
    weights = p / total  # the softmax's weights, 0 where masked and in a row that sees nothing
    dw = jnp.einsum("...td,...sd->...ts", g.astype(v.dtype), v, preferred_element_type=jnp.float32)
    ds = weights * (dw - (g * out).sum(axis=-1, keepdims=True))  # the softmax's derivative
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq = jnp.einsum("...ts,...sd->...td", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = _transposed_product(q, ds.astype(q.dtype))  # (d_k, S): dk transposed
    dv = _transposed_product((g / total).astype(v.dtype), p.astype(v.dtype))  # (d_v, S)
    return (
        (dq * scale).astype(q.dtype),
        (jnp.swapaxes(dk, -1, -2) * scale).astype(k.dtype),
        jnp.swapaxes(dv, -1, -2).astype(v.dtype),
        None,
    )


_attend.defvjp(_attend_forward, _attend_backward)


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
