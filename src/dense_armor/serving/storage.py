"""Where the `Server`'s slots keep their caches: a whole fixed cache per slot (`FixedSlots`), or
pages of one shared pool per layer (`PagedSlots`, `nn.state.paged`), with prefix sharing.

Both answer the engine the same way, for a request's `context` (its prompt, and the tokens it
made before it was preempted): `fits(context)` (can it be admitted now), `admit(i, context)` (all
but its last token prefilled into slot `i`; the position where the prefill began, past the rows
found in shared pages), `grow(i, rows)` (slot `i` holds `rows` positions, False when the pool is
short), `tick(arrays)` (every slot's step and draw), `release(i, written)` (slot `i`'s request
ended, was cancelled or preempted; `written`: the tokens whose rows it holds, for their pages to
be kept by key). Every function compiles once whatever the requests: the prefill once per piece
size, the paged tick once per power of two of pages that the longest request in the batch
holds.
"""

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..nn.layers.language import ids_checked
from ..nn.models.language_model import TransformerLM
from ..nn.state.cache import PositionCache
from ..nn.state.paged import PagedKVCache, copy_page, paged_cache, paged_streams, pool_mask
from .compiled import admit, paged_prefill, paged_tick, prefill, start_stream, tick
from .pages import PageBook

__all__ = ["FixedSlots", "PagedSlots", "prefill_pieces"]


def prefill_pieces(n: int, chunk: int) -> list[int]:
    """The prefill calls for `n` prompt tokens: whole chunks of `chunk`, then the rest in pieces
    of halving sizes (`chunk=16`: 16, ..., then 8, 4, 2, 1 as needed), so a prompt shorter than
    a chunk is not fed one token per tick; each size compiles once."""
    sizes = [chunk] + [1 << k for k in range((chunk - 1).bit_length() - 1, -1, -1)]
    pieces = []
    for size in sizes:
        while n >= size:
            pieces.append(size)
            n -= size
    return pieces


def _pieces(prompt: np.ndarray, start: int, chunk: int) -> Iterator[np.ndarray]:
    """The prefill's pieces of the prompt's tokens from `start` to all but the last."""
    for size in prefill_pieces(len(prompt) - 1 - start, chunk):
        yield prompt[start : start + size]
        start += size


def _bucket(pages: int, most: int) -> int:
    """The table width for `pages` pages: the next power of two, at most `most` (each width
    compiles once)."""
    return min(1 << max(pages - 1, 0).bit_length(), most)


class FixedSlots:
    """A fixed cache of `capacity` positions per slot (`init_streams`); a request is prefilled
    into a fresh cache, then admitted into its slot."""

    def __init__(self, model: TransformerLM, slots: int, capacity: int, kv_dtype: Any, chunk: int):
        self.model, self.slots, self.chunk = model, slots, chunk
        self.fresh = model.init_cache(capacity, on_overflow="nan", kv_dtype=kv_dtype)
        self.caches = model.init_streams(slots, capacity, on_overflow="nan", kv_dtype=kv_dtype)

    def fits(self, context: np.ndarray) -> bool:
        return True

    def admit(self, i: int, context: np.ndarray) -> int:
        cache = self.fresh
        for piece in _pieces(context, 0, self.chunk):
            with ids_checked():  # checked by `submit`
                cache = prefill(self.model, piece, cache)
        self.caches = admit((jnp.arange(self.slots) == i, cache), self.caches)
        return 0

    def grow(self, i: int, rows: int) -> bool:
        return True

    def tick(self, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        with ids_checked():  # prompts were checked by `submit`; the rest are sampled ids
            chosen, self.caches = tick(self.model, self.caches, *arrays)
        return np.asarray(chosen)

    def release(self, i: int, written: np.ndarray | None = None) -> None:
        pass


def shareable(cache: Any) -> bool:
    """Whether a paged stream's state is all pages and counters: then a prefix's pages are all
    of its state, and a later request can start from them."""
    kinds = (PagedKVCache, PositionCache)
    nodes = jax.tree.leaves(cache, is_leaf=lambda n: isinstance(n, kinds))
    return all(isinstance(n, kinds) for n in nodes)


class PagedSlots:
    """Every slot's keys and values in pages of one pool per layer (`pages` pages of
    `page_size` positions; `PageBook` keeps the accounts); `share`: full pages of prompt tokens
    shared between requests with the same prefix."""

    def __init__(
        self, model: TransformerLM, slots: int, capacity: int, kv_dtype: Any, chunk: int,
        pages: int, page_size: int, share: bool | None,
    ) -> None:  # fmt: skip
        self.model, self.slots, self.chunk = model, slots, chunk
        self.width = -(-capacity // page_size)
        one = model.init_cache(capacity, on_overflow="nan", kv_dtype=kv_dtype)
        one = paged_cache(one, pages, page_size, self.width)
        if share and not shareable(one):
            raise ValueError(
                "Server: `share_prefixes=True` needs a model whose every state is its keys and "
                "values (attention layers only); this one keeps other states (recurrent layers "
                "or running means), which pages do not hold."
            )
        self.share = shareable(one) if share is None else bool(share)
        mask = pool_mask(one)  # the same tree for one stream and for the batch
        self.pools, self.fresh = eqx.partition(one, mask)
        self.own = eqx.partition(paged_streams(one, slots), mask)[1]
        self.book = PageBook(pages, page_size)
        self.tables = np.zeros((slots, self.width), np.int32)
        self.held: list[list[int]] = [[] for _ in range(slots)]

    def fits(self, context: np.ndarray) -> bool:
        """Whether the pages of the context (its last token's row, written by the first tick,
        included) can be taken now."""
        return self.book.fits(context, len(context), self.share)

    def admit(self, i: int, context: np.ndarray) -> int:
        plan = self.book.take(context, len(context), self.share)
        if plan.copy is not None:
            self.pools = copy_page(self.pools, *map(np.int32, plan.copy))
            self.book.release([plan.copy[0]])
        self.held[i] = plan.pages
        self.tables[i] = plan.pages[0]  # unused entries: the slot's own first page
        self.tables[i, : len(plan.pages)] = plan.pages
        own = start_stream(self.fresh, self.tables[i], np.int32(plan.start))
        table = self.tables[i, : _bucket(len(plan.pages), self.width)]
        for piece in _pieces(context, plan.start, self.chunk):
            with ids_checked():  # checked by `submit`
                self.pools, own = paged_prefill(self.model, piece, self.pools, own, table)
        self.own = admit((jnp.arange(self.slots) == i, own), self.own)
        if self.share:
            self.book.register(context, plan.pages, len(context) - 1)
        return plan.start

    def grow(self, i: int, rows: int) -> bool:
        """Slot `i`'s pages for `rows` positions, a page more when its tokens pass the last."""
        before = len(self.held[i])
        if not self.book.grow(self.held[i], rows):
            return False
        self.tables[i, before : len(self.held[i])] = self.held[i][before:]
        return True

    def tick(self, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        """The busy slots' step (padded with idle ones to a power of two: a batch of 4 busy
        slots of 32 costs a batch of 4), over the pages of the longest request's width."""
        busy = [i for i in range(self.slots) if self.held[i]]
        idle = [i for i in range(self.slots) if not self.held[i]]
        rows = np.array((busy + idle)[: _bucket(len(busy), self.slots)], np.int32)
        width = _bucket(max(len(self.held[i]) for i in busy), self.width)
        with ids_checked():  # prompts were checked by `submit`; the rest are sampled ids
            chosen, self.pools, self.own = paged_tick(
                self.model, self.pools, self.own, rows, self.tables[rows, :width],
                *(a[rows] for a in arrays),
            )  # fmt: skip
        every = np.zeros(self.slots, np.int32)
        every[rows] = np.asarray(chosen)
        return every

    def release(self, i: int, written: np.ndarray | None = None) -> None:
        if self.share and written is not None:  # its full pages, kept by key for its return
            self.book.register(written, self.held[i], len(written))
        self.book.release(self.held[i])
        self.held[i] = []
        self.tables[i] = 0
