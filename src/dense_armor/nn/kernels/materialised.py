"""Scaled dot-product attention over the materialised scores (Vaswani et al. 2017, Eq.(1),
page 4): the kernel the attention layers use below `BLOCKED_MIN_LENGTH` steps, as `blocked` is
the one in blocks of keys. The attention page imports `scaled_dot_product_attention` and
`attention_weights` from `attention`, which re-exports them.

The softmax is normalised after the product with the values and its derivative is written out
(flash attention's order, with the whole `(T, S)` scores at once); see `_attend`.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..core import ShapeError, type_checked

__all__ = ["attention_weights", "scaled_dot_product_attention"]


def _masked_scores(
    q: Array, k: Array, mask: Array | None, softcap: float | None = None
) -> tuple[Array, Array | None]:
    """The scores `q k^T / sqrt(d_k)` in float32 (`softcap * tanh(s / softcap)` with a
    `softcap`, Gemma 2's), `-inf` where `mask` hides a key, and the mask broadcast to them (or
    `None`).

    The queries are scaled, not the scores (as Equinox, Flax and PyTorch do): a pass over
    `(T, d_k)` instead of `(T, S)`, where XLA's CPU compiler would feed the fused softmax a
    materialised `(..., T, S)` array of the constant. Exact for a power-of-two `d_k`."""
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    scores = jnp.einsum("...td,...sd->...ts", q, k, preferred_element_type=jnp.float32)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    if mask is None:
        return scores, None
    mask = _broadcast_mask(mask, q, k)
    return jnp.where(mask, scores, -jnp.inf), mask


def attention_weights(
    q: Float[Array, "*#batch T d_k"],
    k: Float[Array, "*#batch S d_k"],
    mask: Bool[Array, "..."] | None = None,
    softcap: float | None = None,
) -> Float[Array, "*#batch T S"]:
    """The weights `softmax(q k^T / sqrt(d_k))` of `scaled_dot_product_attention`, in float32.

    Same arguments as `scaled_dot_product_attention`; every row sums to 1, or is all zeros where
    the mask hides every key. `softcap` caps the scores first (`_masked_scores`).
    """
    scores, mask = _masked_scores(q, k, mask, softcap)
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
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    hidden_zeros: bool = False,
    softcap: float | None = None,
) -> Array:
    """`scaled_dot_product_attention`, unchecked. `hidden_zeros=True` (a cache's promise, see
    `KVUpdate`): every value `mask` hides is zero, so none needs zeroing; a row whose output is
    not finite is then made NaN whole, which is the same rule at a pass over `(T, d_v)` instead
    of two over the values and the `(T, S)` mask (half a cached step's time). `softcap`: the
    scores capped (`_masked_scores`), differentiated by JAX's own rules."""

    def capped(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
        return _attend_parts(q, k, v, mask, softcap)[0]

    attend = _attend if softcap is None else capped
    if mask is None or hidden_zeros:
        # every value a query may weigh is one it sees: one non-finite value makes its row NaN
        if mask is not None:
            mask = _broadcast_mask(mask, q, k)
        out = attend(*_common_batch(q, k, v), mask)
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
    out = attend(q, k, clean, mask)
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


def _attend_parts(
    q: Array, k: Array, v: Array, mask: Array | None, softcap: float | None = None
) -> tuple[Array, Array, Array]:
    """`(out, p, total)`: `p = exp(s - max s)` of the masked scores `s` (float32), its row sums
    (1 for a row that sees nothing, whose `p` is all zeros) and `out = (p v) / total`."""
    scores, _ = _masked_scores(q, k, mask, softcap)
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


def scaled_cache_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    key_scales: Array,
    value_scales: Array,
    softcap: float | None = None,
) -> Array:
    """Attention over an int8 cache: keys `k` and values `v` `(..., S, d)` hold the int8 rows
    (in the compute dtype, rotated or not), `key_scales` and `value_scales` `(..., S)` their
    scales. The key scales multiply the scores and the value scales the attention weights, so no
    float copy of the cache is scaled; the softmax is normalised after the product with the
    values, in float32, as `_attention` does. A query that sees no key gets zeros; one that sees a
    non-finite scale gets NaN (inference only: not differentiated through the cache)."""
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    scores = jnp.einsum("...td,...sd->...ts", q, k, preferred_element_type=jnp.float32)
    scores = scores * key_scales[..., None, :].astype(jnp.float32)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    seen = None if mask is None else _broadcast_mask(mask, q, k)
    if seen is not None:
        scores = jnp.where(seen, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isneginf(peak), 0.0, peak)  # a row that sees nothing: exp(-inf) = 0
    p = jnp.exp(scores - peak)
    total = p.sum(axis=-1, keepdims=True)
    weighted = p * value_scales[..., None, :].astype(jnp.float32)
    if seen is not None:  # a hidden row's scale (an old ring row's NaN) weighs nothing
        weighted = jnp.where(seen, weighted, 0.0)
    out = jnp.einsum(
        "...ts,...sd->...td", weighted.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return jnp.where(total == 0, 0.0, out / jnp.where(total == 0, 1.0, total)).astype(q.dtype)
