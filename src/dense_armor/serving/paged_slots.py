"""The `Server`'s paged slots: pages of one shared pool per layer (`nn.state.paged`), taken as
requests grow, with prefix sharing; the same answers to the engine as `storage.FixedSlots` (see
`serving.storage`)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..nn.kernels.paged import kernel_fits
from ..nn.layers.language import ids_checked
from ..nn.models.language_model import TransformerLM
from ..nn.sharding import shard_caches
from ..nn.state.cache import PositionCache
from ..nn.state.paged import PagedKVCache, copy_page, paged_cache, paged_streams, pool_mask
from .compiled import (
    admit,
    compile_now,
    paged_prefill,
    paged_prefill_scored,
    paged_tick,
    start_stream,
)
from .history import Penalised
from .pages import PageBook
from .scoring import PromptScores, Scores, scored_prefill, spread
from .storage import Draw, _pieces, bucket, prefill_pieces

__all__ = ["PagedSlots", "shareable"]


def shareable(cache: Any) -> bool:
    """Whether a paged stream's state is all pages and counters: then a prefix's pages are all
    of its state, and a later request can start from them."""
    kinds = (PagedKVCache, PositionCache)
    nodes = jax.tree.leaves(cache, is_leaf=lambda n: isinstance(n, kinds))
    return all(isinstance(n, kinds) for n in nodes)


def _reads_in_place(cache: Any, width: int, read: str) -> bool:
    """Whether every paged layer of `cache` (one stream's) decodes through the kernel that reads
    the pages in place, at a table of `width` pages (`kernels.paged.kernel_fits`)."""
    nodes = jax.tree.leaves(cache, is_leaf=lambda n: isinstance(n, PagedKVCache))
    paged = [n for n in nodes if isinstance(n, PagedKVCache)]

    def fits(node: PagedKVCache) -> bool:
        pool = jax.ShapeDtypeStruct(node.keys.shape[-4:], node.keys.dtype)
        return kernel_fits(pool, width, 1, node.key_scale is not None, read)

    return bool(paged) and all(map(fits, paged))


class PagedSlots:
    """Every slot's keys and values in pages of one pool per layer (`pages` pages of
    `page_size` positions; `PageBook` keeps the accounts); `share`: full pages of prompt tokens
    shared between requests with the same prefix."""

    def __init__(
        self, model: TransformerLM, slots: int, capacity: int, kv_dtype: Any, chunk: int,
        top: int | None, pages: int, page_size: int, share: bool | None, read: str = "auto",
        mesh: Any = None,
    ) -> None:  # fmt: skip
        self.model, self.slots, self.chunk = model, slots, chunk
        self.top, self.scoring = top or 0, top is not None
        self.prompt_scores: dict[int, PromptScores] = {}  # by slot, until the engine takes them
        self.width = -(-capacity // page_size)
        one = model.init_cache(capacity, on_overflow="nan", kv_dtype=kv_dtype)
        one = shard_caches(paged_cache(one, pages, page_size, self.width, read), mesh)
        # A tick that reads the pages in place (the TPU's kernel) costs the same at any table
        # width (it copies only the pages in use): one width, and a fifth of the compilations.
        self.one_width = _reads_in_place(one, self.width, read)
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
        self.penalised = Penalised(slots, model.vocab)

    def fits(self, context: np.ndarray) -> bool:
        """Whether the pages of the context (its last token's row, written by the first tick,
        included) can be taken now."""
        return self.book.fits(context, len(context), self.share)

    def settle(self) -> dict[int, tuple[int, Scores]]:
        """Nothing left: each request was prefilled into its pages as it was admitted (a later
        one of the round may share the pages an earlier one wrote), all but its last token,
        which the tick feeds (the whole prompt may be in shared pages): no token drawn yet."""
        return {}

    def admit(self, i: int, context: np.ndarray, draw: Draw) -> int:
        """Slot `i`'s request prefilled into its pages now, past those its prompt's prefix
        shares (none for one that wants its prompt's scores: `prompt_scores`, all computed)."""
        share = self.share and not draw.prompt_scored
        plan = self.book.take(context, len(context), share)
        if plan.copy is not None:
            self.pools = shard_caches(copy_page(self.pools, *map(np.int32, plan.copy)))
            self.book.release([plan.copy[0]])
        self.held[i] = plan.pages
        self.tables[i] = 0  # unused entries: the null page (a step past the pages writes there)
        self.tables[i, : len(plan.pages)] = plan.pages
        own = start_stream(self.fresh, self.tables[i], np.int32(plan.start))
        table = self.tables[i, : self._width(len(plan.pages))]
        if draw.prompt_scored:
            own = self._prefill_scored(i, context, own, table)
        else:
            for piece in _pieces(context, plan.start, self.chunk):
                with ids_checked():  # checked by `submit`
                    self.pools, own = paged_prefill(self.model, piece, self.pools, own, table)
        self.own = admit((jnp.arange(self.slots) == i, own), self.own)
        self.penalised.admit(i, context, draw)
        if self.share:
            self.book.register(context, plan.pages, len(context) - 1)
        return plan.start

    def _prefill_scored(self, i: int, context: np.ndarray, own: Any, table: np.ndarray) -> Any:
        """Slot `i`'s prefill of all but the last of `context` that scores its tokens (the
        last one's is the tick's first token)."""

        def run(piece: np.ndarray, following: np.ndarray, own: Any) -> Any:
            with ids_checked():  # checked by `submit`
                self.pools, own, scores = paged_prefill_scored(
                    self.model, piece, self.pools, own, table, following, self.top
                )
            return None, own, scores

        pieces = prefill_pieces(len(context) - 1, self.chunk)
        _, own, self.prompt_scores[i] = scored_prefill(run, context, pieces, own, self.top)
        return own

    def grow(self, i: int, rows: int) -> bool:
        """Slot `i`'s pages for `rows` positions, a page more when its tokens pass the last."""
        before = len(self.held[i])
        if not self.book.grow(self.held[i], rows):
            return False
        self.tables[i, before : len(self.held[i])] = self.held[i][before:]
        return True

    def tick(self, arrays: tuple[np.ndarray, ...], busy: list[int], shape: tuple[int, int]) -> Any:
        """`steps` steps of the busy slots (`shape`: `(steps, top)`; padded with idle ones to a
        power of two: a batch of 4 busy slots of 32 costs a batch of 4), over the pages of the
        longest request's width; the tokens `(steps, slots)` and their scores (`Ticked`). A
        slot's steps past its pages (past its request's end) write into the null page."""
        idle = [i for i in range(self.slots) if i not in busy]
        rows = np.array((busy + idle)[: bucket(len(busy), self.slots)], np.int32)
        width = self._width(max(len(self.held[i]) for i in busy))
        with ids_checked():  # prompts were checked by `submit`; the rest are sampled ids
            chosen, (self.pools, self.own, self.penalised.past) = paged_tick(
                self.model, (self.pools, self.own, self.penalised.past), shape, rows,
                self.tables[rows, :width], *(a[rows] for a in arrays),
            )  # fmt: skip
        return spread(chosen, rows, self.slots)

    def warm(
        self, arrays: tuple[np.ndarray, ...], shape: tuple[int, int], threads: int | None = None
    ) -> None:
        """Compile now, at every table width a request can reach (the powers of two up to the
        whole table), each prefill piece and the tick of every batch size, and the copy of a
        page: whatever its length, sharing or preemption, no later request waits for a
        compilation. They compile `threads` at a time (`compile_now`), then each runs once; a
        call reads and writes only the null page (all-zero tables), and the idle slots' states
        it steps are replaced when a request is admitted (`arrays`: the tick's arrays of idle
        slots)."""
        own = start_stream(self.fresh, np.zeros(self.width, np.int32), np.int32(0))
        plan = self._warm_plan()
        with ids_checked():
            compile_now([self._warm_call(item, arrays, shape, own) for item in plan], threads)
            for item in plan:  # each with the state the one before gave back
                function, arguments = self._warm_call(item, arrays, shape, own)
                if function is paged_tick:
                    _, (self.pools, self.own, self.penalised.past) = function(*arguments)
                else:
                    self.pools, own = function(*arguments)[:2]
        self.pools = shard_caches(copy_page(self.pools, np.int32(0), np.int32(0)))

    def _warm_plan(self) -> list[tuple[Any, int, int]]:
        """`warm`'s calls: `(function, size, width)`, each prefill piece (and scored piece) of
        `size` tokens and each tick of `size` slots, at every table `width`."""
        widths = sorted({self._width(k) for k in range(1, self.width + 1)})
        sizes = sorted(set(prefill_pieces(2 * self.chunk - 1, self.chunk)))
        counts = sorted({bucket(k, self.slots) for k in range(1, self.slots + 1)})
        prefills = [paged_prefill, paged_prefill_scored] if self.scoring else [paged_prefill]
        return [
            *((f, size, width) for width in widths for size in sizes for f in prefills),
            *((paged_tick, count, width) for width in widths for count in counts),
        ]

    def _warm_call(
        self, item: tuple[Any, int, int], arrays: tuple[np.ndarray, ...],
        shape: tuple[int, int], own: Any,
    ) -> tuple[Any, tuple[Any, ...]]:  # fmt: skip
        """One of `warm`'s calls on the null page, with the current pools and states."""
        function, size, width = item
        table = np.zeros(width, np.int32)
        if function is paged_tick:
            rows = np.arange(size, dtype=np.int32)
            state = (self.pools, self.own, self.penalised.past)
            tables = np.zeros((size, width), np.int32)
            return function, (self.model, state, shape, rows, tables, *(a[rows] for a in arrays))
        piece = np.zeros(size, np.int32)  # token 0: in every vocabulary
        scored = (piece, self.top) if function is paged_prefill_scored else ()
        return function, (self.model, piece, self.pools, own, table, *scored)

    def _width(self, pages: int) -> int:
        """The table width a call over `pages` pages runs at: the next power of two (the whole
        table at most), or the whole table where every width costs the same (`one_width`)."""
        return self.width if self.one_width else bucket(pages, self.width)

    def release(self, i: int, written: np.ndarray | None = None) -> None:
        if self.share and written is not None:  # its full pages, kept by key for its return
            self.book.register(written, self.held[i], len(written))
        self.book.release(self.held[i])
        self.held[i] = []
        self.tables[i] = 0
