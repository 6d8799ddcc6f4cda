"""Paged decode attention on the TPU: one new query row per stream against the stream's pages of a
shared pool, read by a Pallas kernel that copies each stream's pages from HBM straight into its
working memory, instead of gathering every stream's pages into a view first (the gather path:
`PagedKVCache.update`'s view, which the CPU and every exported artifact keep).

The kernel (`paged_decode`) runs one grid step per stream, in order: while it attends over
stream `b`'s pages, the copies of stream `b + 1`'s pages are in flight (two buffers), and it
copies only the pages that hold the stream's positions (`ceil((position + 1) / page_size)` of
them). A page is `(n_kv_heads, page_size, d_head)` of the pool, contiguous, so one copy per page
brings every head's rows. The keys are cached unrotated (the cache's protocol): the kernel turns
them by their positions with the layer's cos and sin tables (`rotation_tables`, any `Rotary`),
the rotated half as a product with a signed permutation (exact: one `+-1` per column), and
rounds them to the cache's dtype, as the gather path's rotation does. The scores are
`softcap * tanh(s / softcap)` with a softcap, hidden past the stream's position and before its
window; the values a query does not see are zeroed before the product (a hidden non-finite value
never reaches an output), a seen one that is not finite makes the row NaN, as everywhere else.

What the kernel does not cover takes the gather path, decided at trace time (`kernel_fits`):
several query rows (a prefill), an int8 cache, a working set past `VMEM_BUDGET` (both buffers
of a stream's keys and values), and a cache whose `read` (`nn.state.paged.READS`) says to
gather. `read="kernel"` makes the kernel the choice off the TPU too, in Pallas's interpret mode
(the suite checks it against the gather path on the CPU).
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from .rotary import Rotary

__all__ = ["VMEM_BUDGET", "kernel_fits", "paged_decode", "rotation_tables"]

#: The most bytes of working memory the kernel's buffers may take (two streams' keys and values
#: in the cache's dtype); a larger stream takes the gather path.
VMEM_BUDGET = 24 * 2**20
# The working memory the kernel may take (its buffers, `VMEM_BUDGET` at most, and its temporaries).
_VMEM_LIMIT = 64 * 2**20
# Buffers of streams' pages: the copies of `_DEPTH - 1` streams in flight while one is attended.
_DEPTH = 2


def kernel_fits(
    pool: Array | jax.ShapeDtypeStruct, width: int, queries: int, quantized: bool, read: str
) -> bool:
    """Whether a stream's decode step over `width` pages of `pool (pages, n_kv_heads, page_size,
    d_head)` runs the kernel here: one query row, a float cache, its buffers within
    `VMEM_BUDGET`, and the kernel chosen by the cache's `read` on this platform."""
    if read == "gather" or (read == "auto" and jax.default_backend() != "tpu"):
        return False
    if queries != 1 or quantized or not jnp.issubdtype(pool.dtype, jnp.floating):
        return False
    _, n_kv, size, d = pool.shape
    return _DEPTH * 2 * width * n_kv * size * d * pool.dtype.itemsize <= VMEM_BUDGET


def rotation_tables(rotary: Rotary | None, length: int, d_head: int) -> tuple[Array, ...]:
    """`(cos, sin, turn)`: key `l` rotated is `k * cos[l] + (k @ turn) * sin[l]` (float32 tables
    `(length, d_head)` and `(d_head, d_head)`), the features past the rotated ones passed through
    (cos 1, sin 0); with no rotary, cos 1 and sin 0 everywhere."""
    turn = np.zeros((d_head, d_head), np.float32)
    if rotary is None:
        ones = jnp.ones((length, d_head), jnp.float32)
        return ones, jnp.zeros((length, d_head), jnp.float32), jnp.asarray(turn)
    dims, half = rotary.dims, rotary.dims // 2
    # (k @ turn)[i] = -k[i + half] for i < half, k[i - half] for half <= i < dims
    turn[np.arange(half) + half, np.arange(half)] = -1.0
    turn[np.arange(half), np.arange(half) + half] = 1.0
    probe = jnp.zeros((length, dims), jnp.float32)
    positions = jnp.arange(length)
    # cos and sin as `rotate` makes them: the rotation of unit vectors along the first half
    first = rotary(jnp.concatenate([probe[:, :half] + 1.0, probe[:, half:]], axis=-1), positions)
    cos = jnp.concatenate([first[:, :half], first[:, :half]], axis=-1)
    sin = jnp.concatenate([first[:, half:], first[:, half:]], axis=-1)
    pad = d_head - dims
    cos = jnp.pad(cos, ((0, 0), (0, pad)), constant_values=1.0)
    sin = jnp.pad(sin, ((0, 0), (0, pad)))
    return cos, sin, jnp.asarray(turn)


def _page_span(position: Array, width: int, size: int, window: int | None) -> tuple[Array, Array]:
    """The first page and one past the last that hold positions a query at `position` sees."""
    end = jnp.minimum(position // size + 1, width)
    if window is None:
        return jnp.zeros_like(end), end
    return jnp.clip((position - window + 1) // size, 0, end), end


def _copies(refs: tuple, stream: Array | int, into: Array | int, width: int, action: str) -> None:
    """Start (`action="start"`) or wait for the copies of `stream`'s pages into buffer `into`."""
    table, positions, k_hbm, v_hbm, k_buf, v_buf, sems, size, window = refs
    first, end = _page_span(positions[stream], width, size, window)
    for p in range(width):
        page = jnp.clip(table[stream, p], 0, k_hbm.shape[0] - 1)
        key = pltpu.make_async_copy(k_hbm.at[page], k_buf.at[into, p], sems.at[into, 0])
        value = pltpu.make_async_copy(v_hbm.at[page], v_buf.at[into, p], sems.at[into, 1])

        @pl.when((p >= first) & (p < end))
        def _(key=key, value=value) -> None:
            getattr(key, action)()
            getattr(value, action)()


def _kernel(
    table,
    positions,
    q_ref,
    cos_ref,
    sin_ref,
    turn_ref,
    k_hbm,
    v_hbm,
    o_ref,
    k_buf,
    v_buf,
    sems,
    *,
    window: int | None,
    softcap: float | None,
) -> None:
    """One stream's decode attention (grid step `b`), the next stream's pages copied meanwhile."""
    b, streams = pl.program_id(0), pl.num_programs(0)
    depth, width, size = k_buf.shape[0], k_buf.shape[1], k_buf.shape[3]
    refs = (table, positions, k_hbm, v_hbm, k_buf, v_buf, sems, size, window)
    slot = b % depth

    @pl.when(b == 0)
    def _() -> None:  # the first streams' copies (`depth - 1` of them)
        for ahead in range(depth - 1):

            @pl.when(ahead < streams)
            def _(ahead: int = ahead) -> None:
                _copies(refs, ahead, ahead, width, "start")

    @pl.when(b + depth - 1 < streams)
    def _() -> None:  # the copies of the stream `depth - 1` ahead, into the buffer freed last
        _copies(refs, b + depth - 1, (b + depth - 1) % depth, width, "start")

    _copies(refs, b, slot, width, "wait")
    _attend_rows(q_ref, cos_ref, sin_ref, turn_ref, k_buf, v_buf, o_ref, slot, positions[b],
                 window, softcap)  # fmt: skip


def _attend_rows(q_ref, cos_ref, sin_ref, turn_ref, k_buf, v_buf, o_ref, slot, position,
                 window: int | None, softcap: float | None) -> None:  # fmt: skip
    """Every query head against every row of the stream's buffer `slot` at once, the rows of
    other key/value heads hidden: three products per stream, whatever the heads."""
    _, width, n_kv, size, d = k_buf.shape
    rows, n_heads, dtype = width * n_kv * size, q_ref.shape[1], q_ref.dtype
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    k = k_buf[slot].astype(dtype)  # (width, n_kv, size, d)
    turned = jnp.dot(k.reshape(rows, d), turn_ref[...].astype(dtype), precision=exact,
                     preferred_element_type=jnp.float32).reshape(k.shape)  # fmt: skip
    cos, sin = cos_ref[...][:, None], sin_ref[...][:, None]  # (width, 1, size, d)
    k = (k.astype(jnp.float32) * cos + turned * sin).astype(dtype).reshape(rows, d)
    q = q_ref[0] * jnp.asarray(1.0 / math.sqrt(d), dtype)  # (n_heads, d)
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=exact, preferred_element_type=jnp.float32
    )  # (n_heads, rows)
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    # buffer row `(w, h, i)` (page, head, offset) is `(w n_kv + h) size + i`
    col = jax.lax.broadcasted_iota(jnp.int32, (1, rows), 1)
    seen = _sees(col, size, n_kv, position, window)
    head = jax.lax.broadcasted_iota(jnp.int32, (n_heads, 1), 0) // (n_heads // n_kv)
    s = jnp.where(seen & (head == (col // size) % n_kv), s, -jnp.inf)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    total = p.sum(axis=-1, keepdims=True)
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    v = v_buf[slot].reshape(rows, d).astype(dtype)
    v = jnp.where(_sees(row, size, n_kv, position, window), v, jnp.zeros((), dtype))
    out = jnp.dot(p.astype(dtype), v, precision=exact, preferred_element_type=jnp.float32)
    o_ref[0] = (out / total).astype(o_ref.dtype)


def _sees(index: Array, size: int, n_kv: int, position: Array, window: int | None) -> Array:
    """Whether buffer row `index` (page `w`, head `h`, offset `i`) holds a position the query at
    `position` sees: `w * size + i`, at most `position` and within the `window`."""
    at = (index // (n_kv * size)) * size + index % size
    seen = at <= position
    return seen if window is None else seen & (at > position - window)


def _call(
    q: Array,
    keys: Array,
    values: Array,
    table: Array,
    positions: Array,
    rotation: tuple[Array, ...],
    window: int | None,
    softcap: float | None,
) -> Array:
    """The kernel over a batch: `q (B, n_heads, d)`, `table (B, W)`, `positions (B,)`."""
    streams, n_heads, d = q.shape
    _, n_kv, size, _ = keys.shape
    width = table.shape[1]
    block = pl.BlockSpec((1, n_heads, d), lambda b, *_: (b, 0, 0))
    cos, sin, turn = rotation
    rotation = (cos.reshape(width, size, d), sin.reshape(width, size, d), turn)
    whole = pl.BlockSpec(memory_space=pltpu.VMEM)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    interpret = jax.default_backend() != "tpu"
    out = pl.pallas_call(
        functools.partial(_kernel, window=window, softcap=softcap),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(streams,),
            in_specs=[block, whole, whole, whole, anywhere, anywhere],
            out_specs=block,
            scratch_shapes=[
                pltpu.VMEM((_DEPTH, width, n_kv, size, d), keys.dtype),
                pltpu.VMEM((_DEPTH, width, n_kv, size, d), values.dtype),
                pltpu.SemaphoreType.DMA((_DEPTH, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(table.astype(jnp.int32), positions.astype(jnp.int32), q, *rotation, keys, values)
    return out.reshape(streams, n_heads, d)


def _reference(
    q: Array,
    keys: Array,
    values: Array,
    table: Array,
    position: Array,
    rotation: tuple[Array, ...],
    window: int | None,
    softcap: float | None,
) -> Array:
    """One stream's step as the kernel computes it, in JAX (a batch of pools, each stream its
    own, takes it under `jax.vmap`)."""
    width, (_, n_kv, size, d) = table.shape[0], keys.shape
    pages = jnp.clip(table, 0, keys.shape[0] - 1)
    k = keys[pages].transpose(1, 0, 2, 3).reshape(n_kv, width * size, d).astype(q.dtype)
    v = values[pages].transpose(1, 0, 2, 3).reshape(n_kv, width * size, d).astype(q.dtype)
    cos, sin, turn = rotation
    k = (k.astype(jnp.float32) * cos + (k.astype(jnp.float32) @ turn) * sin).astype(q.dtype)
    col = jnp.arange(width * size)
    seen = (col <= position) & (True if window is None else col > position - window)
    grouped = q.reshape(n_kv, -1, d) * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
    s = jnp.einsum("hgd,hld->hgl", grouped, k, preferred_element_type=jnp.float32)
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(seen, s, -jnp.inf)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    v = jnp.where(seen[:, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("hgl,hld->hgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out / p.sum(axis=-1, keepdims=True)).astype(q.dtype).reshape(q.shape)


@functools.cache
def _decoder(window: int | None, softcap: float | None) -> Any:
    """`paged_decode`'s function for one layer's `window` and `softcap`: one stream's step, and
    under `jax.vmap` (the streams batched, the pools shared) one kernel call for the batch."""

    @custom_vmap
    def decode(*args: Array) -> Array:  # (q, keys, values, table, position, cos, sin, turn)
        q, keys, values, table, position, *rotation = args
        return _call(q[None], keys, values, table[None], position[None], tuple(rotation), window,
                     softcap)[0]  # fmt: skip

    @decode.def_vmap
    def batched(size: int, in_batched: list[bool], *args: Array) -> tuple[Array, bool]:
        if any(in_batched[1:3]) or any(in_batched[5:]):  # pools or tables of their own
            axes = tuple(0 if b else None for b in in_batched)

            def one(*a: Array) -> Array:
                return _reference(a[0], a[1], a[2], a[3], a[4], a[5:], window, softcap)

            return jax.vmap(one, in_axes=axes)(*args), True
        q, keys, values, table, position, *rotation = (
            a if b or i in (1, 2, 5, 6, 7) else jnp.broadcast_to(a, (size, *a.shape))
            for i, (a, b) in enumerate(zip(args, in_batched, strict=True))
        )
        return _call(q, keys, values, table, position, tuple(rotation), window, softcap), True

    return decode


def paged_decode(
    q: Array,
    keys: Array,
    values: Array,
    table: Array,
    position: Array,
    rotation: tuple[Array, ...],
    window: int | None = None,
    softcap: float | None = None,
) -> Array:
    """One stream's decode attention over its pages: `q (n_heads, d_head)` (rotated, unscaled)
    against the rows `0..position` of the pages `table (width,)` lists in the pools
    `keys`, `values (pages, n_kv_heads, page_size, d_head)` (a `window` sees the last `window`
    of them), `rotation` from `rotation_tables`. Returns `(n_heads, d_head)` in `q`'s dtype.
    Under `jax.vmap` over streams sharing the pools, one kernel call runs the batch."""
    cos, sin, turn = rotation
    return _decoder(window, softcap)(q, keys, values, table, position, cos, sin, turn)
