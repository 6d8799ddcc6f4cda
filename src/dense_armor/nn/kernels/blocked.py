"""Memory-efficient attention: `softmax(q k^T / sqrt(d_k)) v` over blocks of keys, with an online
softmax, never holding the `(T, S)` scores (Rabe & Staats 2021, "Self-attention Does Not Need
O(n^2) Memory"; Dao et al. 2022/2023, "FlashAttention", "FlashAttention-2", Algorithms 1 and 2).

The forward keeps, for each query, the running maximum `m`, the running sum `l` of
`exp(score - m)` and the running weighted sum of values, rescaled whenever `m` grows; the result
is `acc / l`, exact up to float32 round-off. Its gradient is its own (`jax.custom_vjp`): the
backward recomputes each block's weights from the saved log-sum-exp `m + log l` instead of
storing them, so forward and backward both need memory linear in the sequence length.

Masks are described, not materialised: `causal`, a sliding `window` and a per-key validity
vector `key_mask (..., S)`. With `causal=True` the blocks above the diagonal (and, with a window,
those that fall out of it) are skipped, not just masked.
"""

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..core import ShapeError, require_bool, require_positive, sees

__all__ = ["BLOCKED_MIN_LENGTH", "blocked_attention", "use_blocked"]

#: Sequences at least this long take the blocked path when a layer leaves the choice to length
#: (`memory_efficient=None`). Below it the materialised `(T, T)` scores are small and a little
#: faster; above it they grow past tens of MiB per head and the blocked path is as fast or
#: faster (figures in the README's Performance section).
BLOCKED_MIN_LENGTH = 2048

_BLOCK_Q = 1024
_BLOCK_K = 512


def use_blocked(memory_efficient: bool | None, queries: object, keys: object) -> bool:
    """Whether a layer attends with `blocked_attention`, for `queries` against `keys` steps:
    its `memory_efficient` setting, or, when that is `None`, whether the scores would hold at
    least `BLOCKED_MIN_LENGTH ** 2` entries per head (`T >= BLOCKED_MIN_LENGTH` for
    self-attention).

    A symbolic length (a shape-polymorphic export) always takes the materialised path, which
    computes the same function and lowers for any length; export with static shapes to keep the
    blocked path."""
    if not (isinstance(queries, int) and isinstance(keys, int)):
        return False
    if memory_efficient is not None:
        return memory_efficient
    return queries * keys >= BLOCKED_MIN_LENGTH**2


def blocked_attention(
    q: Float[Array, "*#batch T d_k"],
    k: Float[Array, "*#batch S d_k"],
    v: Float[Array, "*#batch S d_v"],
    *,
    causal: bool = False,
    window: int | None = None,
    key_mask: Bool[Array, "..."] | None = None,
    block_size: tuple[int, int] = (_BLOCK_Q, _BLOCK_K),
) -> Float[Array, "*#batch T d_v"]:
    """`scaled_dot_product_attention(q, k, v, mask)` in memory linear in `T` and `S`.

    **Arguments:**

    - `q (..., T, d_k)`, `k (..., S, d_k)`, `v (..., S, d_v)`: leading axes broadcast.
    - `causal`: query `t` sees keys `s <= t` (needs `T == S`).
    - `window`: with `causal`, query `t` sees only keys `t - window < s <= t`.
    - `key_mask`: boolean, broadcastable to `(..., S)`; `False` hides a key from every query.
    - `block_size`: `(queries, keys)` per block; the working memory is about
      `batch * block_q * block_k` floats.

    **Returns:** `(..., T, d_v)` in the dtype of `v`, computed in float32. A query that sees no
    key gets zeros, in the output and in the gradient, as in `scaled_dot_product_attention`; a
    hidden key contributes nothing, even where its value is NaN or infinite, and a query that
    sees a non-finite value gets NaN in its whole row.
    """
    block_q, block_k = block_size
    batch, valid = _check_blocked(q, k, v, causal, window, key_mask, block_q, block_k)
    T, S = q.shape[-2], k.shape[-2]
    if T == 0 or S == 0:  # no query, or no key to see: zeros, as a fully hidden row gets
        return jnp.zeros((*batch, T, v.shape[-1]), v.dtype)
    v, sees_non_finite = _finite_values(v, valid, batch, T, causal, window)
    n = math.prod(batch)
    block_q, block_k = min(block_q, max(T, 1)), min(block_k, max(S, 1))
    t_pad, s_pad = -T % block_q, -S % block_k

    def flat(a: Array, length: int, pad: int) -> Array:
        a = jnp.broadcast_to(a.astype(jnp.float32), (*batch, length, a.shape[-1]))
        return jnp.pad(a.reshape(n, length, a.shape[-1]), ((0, 0), (0, pad), (0, 0)))

    valid = jnp.pad(valid.reshape(n, S), ((0, 0), (0, s_pad)))
    blocks = _Blocks(causal, window, block_q, block_k)
    out = _blocked(blocks, flat(q, T, t_pad), flat(k, S, s_pad), flat(v, S, s_pad), valid)
    out = out[:, :T].reshape(*batch, T, v.shape[-1])
    return jnp.where(sees_non_finite[..., None], jnp.nan, out).astype(v.dtype)


def _check_blocked(
    q: Array,
    k: Array,
    v: Array,
    causal: bool,
    window: int | None,
    key_mask: Array | None,
    block_q: int,
    block_k: int,
) -> tuple[tuple[int, ...], Array]:
    """`blocked_attention`'s checks of its arguments; returns the broadcast batch axes and the
    key mask broadcast to `(*batch, S)`."""
    require_positive(block_q=block_q, block_k=block_k)
    require_bool(causal=causal)
    if window is not None:
        require_positive(window=window)
        if not causal:
            raise ValueError(f"`window={window}` needs `causal=True`.")
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ShapeError(
            f"blocked_attention: received q {q.shape}, k {k.shape}, v {v.shape}; expected "
            "`(..., T, d_k)`, `(..., S, d_k)` and `(..., S, d_v)`."
        )
    floating = [jnp.issubdtype(a.dtype, jnp.floating) for a in (q, k, v)]
    if not all(floating):
        raise ShapeError(
            f"blocked_attention: q, k and v must be floating point; received dtypes {q.dtype}, "
            f"{k.dtype}, {v.dtype}. Cast them first (e.g. `q.astype(jnp.float32)`)."
        )
    T, S, d_k = q.shape[-2], k.shape[-2], q.shape[-1]
    if k.shape[-1] != d_k or v.shape[-2] != S:
        raise ShapeError(
            f"blocked_attention: received q {q.shape}, k {k.shape}, v {v.shape}; q and k must "
            "share `d_k` and k and v the key count `S`."
        )
    if causal and T != S:
        raise ShapeError(
            f"blocked_attention: `causal=True` pairs query t with key t; received T={T}, S={S}."
        )
    try:
        batch = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        valid = (
            jnp.ones((*batch, S), bool)
            if key_mask is None
            else jnp.broadcast_to(key_mask, (*batch, S))
        )
    except ValueError:
        raise ShapeError(
            f"blocked_attention: the leading axes of q {q.shape}, k {k.shape}, v {v.shape} and "
            f"`key_mask` {None if key_mask is None else key_mask.shape} do not broadcast."
        ) from None
    return batch, valid


def _finite_values(
    v: Array, valid: Array, batch: tuple[int, ...], T: int, causal: bool, window: int | None
) -> tuple[Array, Array]:
    """`v` with its non-finite values zeroed, and for each query `(*batch, T)` whether it sees one.

    A hidden key's weight is exactly 0, but 0 * NaN is NaN: zeroing the value keeps a hidden NaN
    out of every row, and marking the rows that do see it keeps NaN in, as without a mask.
    """
    finite = jnp.broadcast_to(jnp.isfinite(v).all(axis=-1), valid.shape)
    bad = (valid & ~finite).astype(jnp.int32)  # (*batch, S): a visible key with a bad value
    if not causal:
        sees_bad = jnp.broadcast_to(bad.any(axis=-1, keepdims=True), (*batch, T))
    else:  # query t sees keys t - window < s <= t: count the bad ones by a running sum
        seen = jnp.cumsum(bad, axis=-1)
        if window is not None:
            before = jnp.pad(seen, [(0, 0)] * len(batch) + [(window, 0)])[..., :T]
            seen = seen - before
        sees_bad = seen > 0
    clean = jnp.where(jnp.isfinite(v).all(axis=-1, keepdims=True), v, jnp.zeros((), v.dtype))
    return clean, sees_bad


class _Blocks(NamedTuple):
    """The static layout of a blocked attention: its mask's description and its block sizes."""

    causal: bool
    window: int | None
    block_q: int
    block_k: int

    def queries(self, a: Array, i: Array) -> Array:
        """Query block `i` of `a (n, T, ...)`."""
        return jax.lax.dynamic_slice_in_dim(a, i * self.block_q, self.block_q, axis=1)

    def keys(self, a: Array, j: Array) -> Array:
        """Key block `j` of `a (n, S, ...)`."""
        return jax.lax.dynamic_slice_in_dim(a, j * self.block_k, self.block_k, axis=1)

    def key_range(self, i: Array, n_k: int) -> tuple[Array, Array]:
        """The key blocks `[lo, hi)` that query block `i` can see."""
        if not self.causal:
            return jnp.asarray(0), jnp.asarray(n_k)
        last_query = (i + 1) * self.block_q - 1
        hi = jnp.minimum(last_query // self.block_k + 1, n_k)
        lo = jnp.asarray(0)
        if self.window is not None:
            lo = jnp.maximum(i * self.block_q - self.window + 1, 0) // self.block_k
        return lo, hi

    def query_range(self, j: Array, n_q: int) -> tuple[Array, Array]:
        """The query blocks `[lo, hi)` that can see key block `j`."""
        if not self.causal:
            return jnp.asarray(0), jnp.asarray(n_q)
        lo = (j * self.block_k) // self.block_q
        hi = jnp.asarray(n_q)
        if self.window is not None:
            last_query = (j + 1) * self.block_k - 1 + self.window - 1
            hi = jnp.minimum(last_query // self.block_q + 1, n_q)
        return lo, hi

    def mask(self, i: Array, j: Array, valid_j: Array) -> Array:
        """Which keys of block `j` each query of block `i` sees, `(n, block_q, block_k)`."""
        mask = valid_j[:, None, :]
        if self.causal:
            rows = i * self.block_q + jnp.arange(self.block_q)[:, None]
            cols = j * self.block_k + jnp.arange(self.block_k)[None, :]
            mask = mask & sees(rows, cols, self.window)[None]
        return mask


def _scores(q_i: Array, k_j: Array) -> Array:
    scale = 1.0 / math.sqrt(q_i.shape[-1])
    return jnp.einsum("nqd,nkd->nqk", q_i * scale, k_j)


def _forward(blocks: _Blocks, q: Array, k: Array, v: Array, valid: Array) -> tuple[Array, Array]:
    n, t, _ = q.shape
    n_q, n_k = t // blocks.block_q, k.shape[1] // blocks.block_k
    d_v = v.shape[-1]

    def query_block(i: Array) -> tuple[Array, Array]:
        q_i = blocks.queries(q, i)

        def key_block(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            m, total, acc = carry
            mask = blocks.mask(i, j, blocks.keys(valid, j))
            s = jnp.where(mask, _scores(q_i, blocks.keys(k, j)), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            # A row with nothing visible yet keeps max -inf; 0 stands in so exp() gives 0, not NaN.
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            rescale = jnp.exp(m - m_safe)
            total = total * rescale + p.sum(axis=-1)
            acc = acc * rescale[..., None] + jnp.einsum("nqk,nkd->nqd", p, blocks.keys(v, j))
            return m_new, total, acc

        lo, hi = blocks.key_range(i, n_k)
        start = (
            jnp.full((n, blocks.block_q), -jnp.inf),
            jnp.zeros((n, blocks.block_q)),
            jnp.zeros((n, blocks.block_q, d_v)),
        )
        m, total, acc = jax.lax.fori_loop(lo, hi, key_block, start)
        seen = total > 0
        out = acc / jnp.where(seen, total, 1.0)[..., None]
        # log-sum-exp of each row; +inf for a row that saw nothing, so exp(s - lse) = 0 there.
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
        return out, lse

    out, lse = jax.lax.map(query_block, jnp.arange(n_q))
    out = out.transpose(1, 0, 2, 3).reshape(n, t, d_v)
    return out, lse.transpose(1, 0, 2).reshape(n, t)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked(blocks: _Blocks, q: Array, k: Array, v: Array, valid: Array) -> Array:
    return _forward(blocks, q, k, v, valid)[0]


def _blocked_fwd(
    blocks: _Blocks, q: Array, k: Array, v: Array, valid: Array
) -> tuple[Array, tuple[Array, ...]]:
    out, lse = _forward(blocks, q, k, v, valid)
    return out, (q, k, v, valid, out, lse)


def _blocked_bwd(
    blocks: _Blocks, residuals: tuple[Array, ...], d_out: Array
) -> tuple[Array, Array, Array, None]:
    q, k, v, valid, out, lse = residuals
    t, d_k = q.shape[1:]
    n_q, n_k = t // blocks.block_q, k.shape[1] // blocks.block_k
    scale = 1.0 / math.sqrt(d_k)
    # D_i = rowsum(dO_i * O_i) = sum_s P_is dP_is (FlashAttention-2, Algorithm 2, line 4).
    delta = (d_out * out).sum(axis=-1)

    def key_block(dq: Array, j: Array) -> tuple[Array, tuple[Array, Array]]:
        k_j, v_j, valid_j = blocks.keys(k, j), blocks.keys(v, j), blocks.keys(valid, j)

        def query_block(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            dq, dk_j, dv_j = carry
            q_i, do_i = blocks.queries(q, i), blocks.queries(d_out, i)
            lse_i, delta_i = blocks.queries(lse, i), blocks.queries(delta, i)
            mask = blocks.mask(i, j, valid_j)
            p = jnp.where(mask, jnp.exp(_scores(q_i, k_j) - lse_i[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum("nqk,nqd->nkd", p, do_i)
            dp = jnp.einsum("nqd,nkd->nqk", do_i, v_j)
            ds = p * (dp - delta_i[..., None]) * scale
            dq_i = blocks.queries(dq, i) + jnp.einsum("nqk,nkd->nqd", ds, k_j)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * blocks.block_q, axis=1)
            dk_j = dk_j + jnp.einsum("nqk,nqd->nkd", ds, q_i)
            return dq, dk_j, dv_j

        lo, hi = blocks.query_range(j, n_q)
        start = (dq, jnp.zeros_like(k_j), jnp.zeros_like(v_j))
        dq, dk_j, dv_j = jax.lax.fori_loop(lo, hi, query_block, start)
        return dq, (dk_j, dv_j)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros_like(q), jnp.arange(n_k))
    dk = dk.transpose(1, 0, 2, 3).reshape(k.shape)
    dv = dv.transpose(1, 0, 2, 3).reshape(v.shape)
    return dq, dk, dv, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
