"""Where the `Server`'s slots keep their caches: a whole fixed cache per slot (`FixedSlots`), or
pages of one shared pool per layer (`PagedSlots`, `nn.state.paged`), with prefix sharing.

Both answer the engine the same way, for a request's `context` (its prompt, and the tokens it
made before it was preempted): `fits(context)` (can it be admitted now), `admit(i, context,
rules)` (its prefill into slot `i`; the position where the prefill begins, past the rows found
in shared pages), `settle()` (the round's admissions done; the first token of each request whose
whole prompt was prefilled, by slot: the fixed slots prefill the round's requests together
there and draw their first tokens with `rules`; a paged slot's prefill stops before the last
token, which the tick feeds), `grow(i, rows)` (slot `i` holds `rows` positions, False when the
pool is short), `tick(arrays, busy)` (the busy slots' step and draw), `release(i, written)`
(slot `i`'s request ended, was cancelled or preempted; `written`: the tokens whose rows it
holds, for their pages to be kept by key). Every function compiles once whatever the requests:
the prefill once per piece size (the fixed slots' batched prefill, admission and first draw
once per piece size and power of two of requests), the tick once per power of two of busy slots
(and, paged, of pages that the longest request in the batch holds).
"""

from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..nn.kernels.paged import kernel_fits
from ..nn.layers.language import ids_checked
from ..nn.models.language_model import TransformerLM
from ..nn.penalties import Penalties
from ..nn.state.cache import PositionCache
from ..nn.state.paged import PagedKVCache, copy_page, paged_cache, paged_streams, pool_mask
from .compiled import (
    admit,
    admit_rows,
    compile_now,
    first_tokens,
    fresh_rows,
    paged_prefill,
    paged_prefill_scored,
    paged_tick,
    prefill,
    prefill_rows,
    prefill_scored,
    put_row,
    row_of,
    start_stream,
    tick,
    tick_rows,
)
from .history import Penalised
from .pages import PageBook
from .scoring import PromptScores, Scores, scored_prefill, spread

__all__ = ["Draw", "FixedSlots", "PagedSlots", "bucket", "prefill_pieces"]


class Draw(NamedTuple):
    """What draws a request's tokens: its key data (2,) uint32, its row of sampling rules
    (`Sampling.row`), whether it wants its new tokens' scores, and its prompt's, its penalties
    and its prompt's length (what of a context is its prompt, the rest its output)."""

    key: np.ndarray
    rules: tuple[float, int, float, float]
    scored: bool
    prompt_scored: bool
    penalties: Penalties = Penalties()
    prompt: int = 0
    constraint: Any = None  # a `grammar.Constraint` on its tokens


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


def bucket(count: int, most: int) -> int:
    """The size compiled for `count` (pages of a table, requests of a batch): the next power of
    two, at most `most` (each size compiles once)."""
    return min(1 << max(count - 1, 0).bit_length(), most)


class FixedSlots:
    """A fixed cache of `capacity` positions per slot (`init_streams`). The requests admitted in
    a round are prefilled together at `settle`, each whole prompt, and the first new token of
    each drawn from the prefill's logits: a request's first token costs its prefill, not a tick
    more."""

    def __init__(
        self, model: TransformerLM, slots: int, capacity: int, kv_dtype: Any, chunk: int,
        top: int | None,
    ) -> None:  # fmt: skip
        """(`top`: the alternatives scored; None: no request asks for scores.)"""
        self.model, self.slots, self.chunk, self.top = model, slots, chunk, top or 0
        self.capacity, self.kv_dtype = capacity, kv_dtype
        self.prompt_scores: dict[int, PromptScores] = {}  # by slot, until the engine takes them
        self.caches = model.init_streams(slots, capacity, on_overflow="nan", kv_dtype=kv_dtype)
        self._slot_bytes = sum(a.nbytes for a in jax.tree.leaves(self.caches)) // slots
        self._weight_bytes = sum(a.nbytes for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        self._waiting: list[tuple[int, np.ndarray, Draw]] = []  # admitted, not yet prefilled
        self.penalised = Penalised(slots, model.vocab)

    def fits(self, context: np.ndarray) -> bool:
        return True

    def admit(self, i: int, context: np.ndarray, rules: Draw) -> int:
        """Slot `i`'s request, prefilled at `settle` with the round's others; `rules` (its key
        data and its row of sampling rules) draw its first token there."""
        self._waiting.append((i, context, rules))
        self.penalised.admit(i, context, rules)
        return 0

    def settle(self) -> dict[int, tuple[int, Scores]]:
        """The round's requests prefilled into their slots (together; one that wants its
        prompt's scores alone, `prompt_scores`); the first new token of each, by slot, drawn as
        a tick would draw it after the prompt's last token, with its scores."""
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return {}
        hidden = {}
        plain = [(i, context) for i, context, draw in waiting if not draw.prompt_scored]
        if plain:
            rows, last = self._prefill_together([context for _, context in plain])
            slots = np.array([i for i, _ in plain] + [0] * (len(last) - len(plain)), np.int32)
            self.caches = admit_rows((slots, np.int32(len(plain)), rows), self.caches)
            hidden.update({i: last[r] for r, (i, _) in enumerate(plain)})
        for i, context, draw in waiting:
            if draw.prompt_scored:
                cache, hidden[i], self.prompt_scores[i] = self._prefill_scored(context)
                one = jax.tree.map(lambda a: a[None], cache)
                self.caches = admit_rows((np.array([i], np.int32), np.int32(1), one), self.caches)
        return self._first_tokens(waiting, hidden)

    def _first_tokens(
        self, waiting: list[tuple[int, np.ndarray, Draw]], hidden: dict[int, Any]
    ) -> dict[int, tuple[int, Scores]]:
        """Each waiting request's first token and its scores, drawn from its prompt's last
        output (`hidden`, by slot) in one call (padded to a power of two of rows)."""
        count = bucket(len(waiting), self.slots)  # padded rows draw greedily; dropped
        keys, positions = np.zeros((count, 2), np.uint32), np.zeros(count, np.int32)
        table = np.tile(np.array([0.0, 0.0, 1.0, 0.0]), (count, 1))
        wanted, slots = np.zeros(count, bool), np.full(count, -1, np.int32)
        for row, (i, context, draw) in enumerate(waiting):
            keys[row], table[row], positions[row] = draw.key, draw.rules, len(context)
            wanted[row], slots[row] = draw.scored, i
        last = np.stack([np.asarray(hidden[i]) for i, _, _ in waiting])
        last = np.concatenate([last, np.repeat(last[:1], count - len(waiting), 0)])
        (tokens, scores), self.penalised.past = first_tokens(
            self.model, self.penalised.past, self.top, slots, last, keys, positions,
            table[:, 0].astype(np.float32), table[:, 1].astype(np.int32),
            table[:, 2].astype(np.float32), table[:, 3].astype(np.float32), wanted,
        )  # fmt: skip
        chosen = np.asarray(tokens).tolist()
        own, ids, values = (np.asarray(a) for a in scores)
        return {
            i: (chosen[r], Scores(float(own[r]), ids[r], values[r]))
            for r, (i, _, _) in enumerate(waiting)
        }

    def _prefill_scored(self, context: np.ndarray) -> tuple[Any, Any, PromptScores]:
        """One stream's prefill of `context` that scores its tokens (`prefill_scored`)."""
        cache = row_of(fresh_rows(self.model, 1, self.capacity, self.kv_dtype), np.int32(0))

        def run(piece: np.ndarray, following: np.ndarray, cache: Any) -> Any:
            with ids_checked():  # checked by `submit`
                return prefill_scored((self.model, piece, following, self.top), cache)

        pieces = prefill_pieces(len(context), self.chunk)
        last, cache, scores = scored_prefill(run, context, pieces, cache, self.top)
        return cache, last, scores

    def _prefill_together(self, contexts: list[np.ndarray]) -> tuple[Any, np.ndarray]:
        """The streams of `contexts` as a batch (padded with copies of the first to a power of
        two of rows: each size compiles once), and the last block's output after each one's
        last token. Their common length is prefilled as one batch, reading the weights once per
        piece for all: requests that arrive together wait for one prefill, not for each
        other's in turn. A longer one's rest is prefilled alone, from its row, and put back."""
        common, count = min(map(len, contexts)), bucket(len(contexts), self.slots)
        heads = [c[:common] for c in contexts]
        ids = np.stack(heads + heads[:1] * (count - len(contexts)))
        rows = fresh_rows(self.model, count, self.capacity, self.kv_dtype)
        last, rows = self._pieces(prefill_rows, ids, rows, 0)
        hidden = np.array(last)
        for row, context in enumerate(contexts):
            if len(context) > common:
                last, cache = self._pieces(prefill, context, row_of(rows, np.int32(row)), common)
                rows = put_row((cache, np.int32(row)), rows)
                hidden[row] = np.asarray(last)
        return rows, hidden

    def _pieces(self, compiled: Any, ids: np.ndarray, state: Any, start: int) -> tuple[Any, Any]:
        """`compiled` (`prefill`, or `prefill_rows` for a batch) over the tokens of `ids` from
        `start` on, in the pieces of `prefill_pieces`: the last output and the state."""
        for size in prefill_pieces(ids.shape[-1] - start, self.chunk):
            with ids_checked():  # checked by `submit`
                last, state = compiled((self.model, ids[..., start : start + size]), state)
            start += size
        return last, state

    def grow(self, i: int, rows: int) -> bool:
        return True

    def tick(self, arrays: tuple[np.ndarray, ...], busy: list[int], shape: tuple[int, int]) -> Any:
        """`steps` steps of the busy slots (`shape`: `(steps, top)`; padded with idle ones to a
        power of two: one busy slot of 8 costs a batch of 1, not 8), their caches taken out and
        put back; every slot's steps in place when most are busy, or when moving the busy
        slots' caches would move more bytes than a step reads of the weights (a long capacity).
        The tokens `(steps, slots)` and their scores (`Ticked`)."""
        count = bucket(len(busy), self.slots)
        with ids_checked():  # prompts were checked by `submit`; the rest are sampled ids
            state = (self.caches, self.penalised.past)
            if count == self.slots or 2 * count * self._slot_bytes > self._weight_bytes:
                every, (self.caches, self.penalised.past) = tick(self.model, state, shape, *arrays)
                return spread(every, np.arange(self.slots), self.slots)
            idle = [i for i in range(self.slots) if i not in busy]
            rows = np.array((busy + idle)[:count], np.int32)
            some, (self.caches, self.penalised.past) = tick_rows(
                self.model, state, shape, rows, *(a[rows] for a in arrays)
            )
        return spread(some, rows, self.slots)

    def release(self, i: int, written: np.ndarray | None = None) -> None:
        pass


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
    ) -> None:  # fmt: skip
        self.model, self.slots, self.chunk = model, slots, chunk
        self.top, self.scoring = top or 0, top is not None
        self.prompt_scores: dict[int, PromptScores] = {}  # by slot, until the engine takes them
        self.width = -(-capacity // page_size)
        one = model.init_cache(capacity, on_overflow="nan", kv_dtype=kv_dtype)
        one = paged_cache(one, pages, page_size, self.width, read)
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
            self.pools = copy_page(self.pools, *map(np.int32, plan.copy))
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
        self.pools = copy_page(self.pools, np.int32(0), np.int32(0))

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
