"""The paged key/value cache: one pool of fixed-size pages per layer, shared by every stream, and
a page table per stream (vLLM's paged attention, read here by a gather: no custom kernel).

A pool holds `pages` pages of `page_size` positions of every key/value head, `(pages, n_kv_heads,
page_size, d_head)`; a stream's `table (width,)` lists its pages in order, so its position `p` lies
in page `table[p // page_size]` at row `p % page_size`. `PagedKVCache.update` answers the one cache
protocol (`KeyValueCache`): it writes the new steps' rows into the stream's pages, then gathers its
pages into a view `(n_kv_heads, width * page_size, d_head)` that the attention reads with the usual
causal mask (and the layer's window, if it has one); rotary positions are the view's rows. The
view's rows past the stream's index hold whatever their pages held before (another request's rows):
the mask hides them and the attention zeroes hidden values, so they never reach an output.

Page 0 is the null page: no stream owns it. A table's unused entries may point to it, and a
step past a stream's pages (which the page owner never lets happen) writes there: every index is
inside the pool by construction, whatever runtime runs the step.

A scanned stack's caches (`scan_layers=True`) carry the layers' axis first: its pools are
`(depth, pages, ...)`, its tables and counters `(depth, ...)`, every layer the same pages
(`with_tables` broadcasts a stream's table to them); the stack's scan hands each layer its slice.

A batch of streams shares the pools: `paged_streams` gives every stream its own table and
counters (a leading batch axis) and the pools none; `stream_axes` is the `jax.vmap` axes of such
a batch (`None` for the pools). Under `jax.vmap`, each stream's write of its rows is batched into
one scatter into the shared pool (`_write_pages`, a `custom_vmap`): the streams own disjoint pages
(a shared page is copied before anyone writes into it, `copy_page`), so the order of their
writes does not matter, and the pool stays one pool, updated in place under donation.
"""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from ..core import ShapeError, require_int, sees
from .cache import Counted, FixedKVCache, KeyValueCache, KVUpdate, RingKVCache
from .counter import Counter
from .rows import _quantized

__all__ = ["READS", "PagedKVCache", "copy_page", "paged_cache", "paged_streams", "stream_axes"]

#: How a paged cache's decode step reads its pages (`PagedKVCache.read`, a static field: part of
#: what a compiled step is): `"auto"` the Pallas kernel on a TPU (`nn.kernels.paged`) and the
#: gather elsewhere, `"kernel"` the kernel everywhere (Pallas's interpret mode off a TPU: slow, for
#: checking it), `"gather"` the gather everywhere. A prefill, an int8 cache and an exported step
#: always gather.
READS = ("auto", "kernel", "gather")


@custom_vmap
def _write_pages(pool: Array, index: Array, rows: Array) -> Array:
    """`pool (N, d)` with `rows (K, d)` written at rows `index (K,)` (in range: the caller's)."""
    return pool.at[index].set(rows.astype(pool.dtype), mode="promise_in_bounds")


@_write_pages.def_vmap
def _write_pages_batched(
    size: int, batched: tuple[bool, bool, bool], pool: Array, index: Array, rows: Array
) -> tuple[Array, bool]:
    """A batch of streams writing into one shared pool: one scatter of all their rows, and the
    pool stays unbatched. A batch of pools (each stream its own) writes each its own."""
    index = index if batched[1] else jnp.broadcast_to(index, (size, *index.shape))
    rows = rows if batched[2] else jnp.broadcast_to(rows, (size, *rows.shape))
    if batched[0]:
        return jax.vmap(_write_pages)(pool, index, rows), True
    return _write_pages(pool, index.reshape(-1), rows.reshape(-1, rows.shape[-1])), False


def _write(pool: Array, table: Array, rows: Array, positions: Array) -> Array:
    """`pool (P, n_heads, S, d)` with `rows (n_heads, K, d)` at `positions (K,)` of the stream
    whose pages `table` lists; a position past the table lands in the null page."""
    pages, n_heads, size, d = pool.shape
    page_index = positions // size
    inside = page_index < table.shape[0]
    page = jnp.where(inside, table[jnp.clip(page_index, 0, table.shape[0] - 1)], 0)
    page = jnp.clip(page, 0, pages - 1)
    heads = jnp.arange(n_heads, dtype=page.dtype)[:, None]
    # row (page, head, offset) of the pool seen as (P * n_heads * S, d)
    index = (page[None, :] * n_heads + heads) * size + jnp.mod(positions, size)[None, :]
    index = index.reshape(-1)
    flat = pool.reshape(pages * n_heads * size, d)
    written = _write_pages(flat, index, rows.reshape(-1, d))
    return written.reshape(pool.shape)


def _view(pool: Array, table: Array) -> Array:
    """A stream's pages in order, `(n_heads, width * page_size, d)`. (A page's rows of every
    head lie together in the pool: the gather copies whole pages, the layout XLA's CPU code
    gathers fastest, 1.7x a gather of each head's rows.)"""
    pages = jnp.take(pool, jnp.clip(table, 0, pool.shape[0] - 1), axis=0, mode="clip")
    width, n_heads, size, d = pages.shape
    return pages.transpose(1, 0, 2, 3).reshape(n_heads, width * size, d)


class PagedKVCache(KeyValueCache, Counted):
    """A stream's keys and values in pages of a shared pool: `keys` and `values` the pools,
    `(pages, n_kv_heads, page_size, d_head)`, `table (width,)` the stream's pages in order, and
    its `counter` (the index of its next position; its limit, `width * page_size` at most). An
    int8 cache holds int8 pools and their float32 scales, `(pages, n_kv_heads, page_size, 1)`.
    A windowed layer reads its window of the stream's pages (positions never fold)."""

    keys: Float[Array, "pages n_heads page_size d_head"] | Int[Array, "pages n_heads page_size d"]
    values: Float[Array, "pages n_heads page_size d_head"] | Int[Array, "pages n_heads size d"]
    table: Int[Array, " width"]
    counter: Counter
    key_scale: Float[Array, "pages n_heads page_size 1"] | None = None
    value_scale: Float[Array, "pages n_heads page_size 1"] | None = None
    read: str = eqx.field(static=True, default="auto")

    fixed_shape: ClassVar[bool] = True

    @property
    def page_size(self) -> int:
        return self.keys.shape[2]

    def update(self, keys: Array, values: Array, window: int | None, owner: str) -> KVUpdate:
        if self.keys.ndim != 4 or (self.keys.shape[1], self.keys.shape[3]) != (
            keys.shape[0],
            keys.shape[2],
        ):
            raise ShapeError(
                f"{owner}: received a paged cache of pool shape {self.keys.shape}; expected "
                f"`(pages, n_heads={keys.shape[0]}, page_size, d_head={keys.shape[2]})`."
            )
        positions, fits, counter = self.counter.advance(keys.shape[1])
        key_scale = value_scale = scales = None
        if self.key_scale is not None and self.value_scale is not None:  # an int8 cache
            keys, values, new_key_scale, new_value_scale = _quantized(keys, values)
            key_scale = _write(self.key_scale, self.table, new_key_scale, positions)
            value_scale = _write(self.value_scale, self.table, new_value_scale, positions)
            scales = (_view(key_scale, self.table)[..., 0], _view(value_scale, self.table)[..., 0])
        pool_keys = _write(self.keys, self.table, keys, positions)
        pool_values = _write(self.values, self.table, values, positions)
        key_positions = jnp.arange(self.table.shape[0] * self.page_size, dtype=positions.dtype)
        cache = PagedKVCache(
            keys=pool_keys, values=pool_values, table=self.table, counter=counter,
            key_scale=key_scale, value_scale=value_scale, read=self.read,
        )  # fmt: skip
        return KVUpdate(
            _view(pool_keys, self.table),
            _view(pool_values, self.table),
            sees(positions[:, None], key_positions[None, :], window),
            fits,
            cache,
            positions,
            key_positions,
            key_scales=None if scales is None else scales[0],
            value_scales=None if scales is None else scales[1],
            pages=None if scales else (pool_keys, pool_values, self.table, window, self.read),
        )

    def guard(self, y: Array, fits: Array) -> Array:
        return self.counter.guard(y, fits, "the paged key/value cache's pages are full")


def _is_paged_source(node: Any) -> bool:
    return isinstance(node, FixedKVCache | RingKVCache)


def paged_cache(cache: Any, pages: int, page_size: int, width: int, read: str = "auto") -> Any:
    """One stream's fixed cache (`init_cache(capacity, kv_dtype=...)`) with every key/value cache
    (fixed or ring) turned into a `PagedKVCache` over a pool of `pages` pages of `page_size`
    positions and a table of `width` pages (all the null page); the other states (positions'
    counters, recurrent states) as they are. `read`: how a decode step reads its pages (`READS`)."""
    require_int(1, caller="paged_cache", page_size=page_size, width=width)
    require_int(2, caller="paged_cache", pages=pages)
    if read not in READS:
        raise ValueError(f"paged_cache: `read` must be one of {READS}; received `read={read!r}`.")

    def one(node: Any) -> Any:
        if not _is_paged_source(node):
            return node
        *depth, n_heads, _, d_head = node.keys.shape  # `depth`: the layers of a scanned stack
        zeros = jnp.zeros((*depth, pages, n_heads, page_size, d_head), node.keys.dtype)
        scales = None
        if node.key_scale is not None:
            scales = jnp.zeros((*depth, pages, n_heads, page_size, 1), jnp.float32)
        mode = node.on_overflow if isinstance(node, FixedKVCache) else "nan"
        counter = Counter.start(mode, width * page_size)
        counter = jax.tree.map(lambda a: jnp.broadcast_to(a, (*depth, *a.shape)), counter)
        table = jnp.zeros((*depth, width), jnp.int32)
        return PagedKVCache(
            keys=zeros, values=zeros.copy(), table=table, counter=counter, key_scale=scales,
            value_scale=_copy(scales), read=read,
        )  # fmt: skip

    return jax.tree.map(one, cache, is_leaf=_is_paged_source)


def _copy(a: Array | None) -> Array | None:
    return None if a is None else a.copy()


def pool_mask(cache: Any) -> Any:
    """The cache's tree with `True` at the pools' arrays (shared by a batch of streams) and
    `False` at every stream's own (tables, counters, other states)."""

    def one(node: Any) -> Any:
        if not isinstance(node, PagedKVCache):
            return jax.tree.map(lambda _: False, node)
        mask = jax.tree.map(lambda _: True, node)
        own = lambda m: (m.table, m.counter.index, m.counter.overflow)  # noqa: E731
        return eqx.tree_at(own, mask, (False, False, False))

    return jax.tree.map(one, cache, is_leaf=lambda n: isinstance(n, PagedKVCache))


def paged_streams(cache: Any, batch: int) -> Any:
    """A paged stream's cache (`paged_cache`) for `batch` streams: the pools shared, every other
    array with a leading batch axis."""
    require_int(1, caller="paged_streams", batch=batch)
    mask = pool_mask(cache)

    def one(leaf: Array, shared: bool) -> Array:
        return leaf if shared else jnp.broadcast_to(leaf, (batch, *jnp.shape(leaf))).copy()

    return jax.tree.map(one, cache, mask)


def stream_axes(cache: Any) -> Any:
    """The `jax.vmap` axes of a batch of paged streams: `None` for the pools, 0 elsewhere."""
    return jax.tree.map(lambda shared: None if shared else 0, pool_mask(cache))


def with_tables(cache: Any, table: Array) -> Any:
    """`cache` with every paged cache's table `table` (the layers share a stream's pages)."""

    def one(node: Any) -> Any:
        if not isinstance(node, PagedKVCache):
            return node
        given = jnp.asarray(table, node.table.dtype)
        if node.table.ndim > given.ndim:  # a scanned stack's: every layer the same pages
            shape = (*node.table.shape[:-1], given.shape[-1])
            given = jnp.broadcast_to(jnp.expand_dims(given, -2), shape)
        return eqx.tree_at(lambda c: c.table, node, given)

    return jax.tree.map(one, cache, is_leaf=lambda n: isinstance(n, PagedKVCache))


def copy_page(cache: Any, source: ArrayLike, target: ArrayLike) -> Any:
    """`cache` with page `source` of every pool copied into page `target` (copy on write: a
    stream about to write into a page that others share writes into its own copy)."""

    def one(node: Any) -> Any:
        if not isinstance(node, PagedKVCache):
            return node
        axis = node.keys.ndim - 4  # the pages' axis: 1 in a scanned stack's pools
        last = node.keys.shape[axis] - 1
        src, dst = jnp.clip(source, 0, last), jnp.clip(target, 0, last)

        def copied(p: Array) -> Array:
            page = lax.dynamic_index_in_dim(p, src, axis, keepdims=False)
            return lax.dynamic_update_index_in_dim(p, page, dst, axis)

        scales = [None if p is None else copied(p) for p in (node.key_scale, node.value_scale)]
        return PagedKVCache(
            keys=copied(node.keys), values=copied(node.values), table=node.table,
            counter=node.counter, key_scale=scales[0], value_scale=scales[1], read=node.read,
        )  # fmt: skip

    return jax.tree.map(one, cache, is_leaf=lambda n: isinstance(n, PagedKVCache))
