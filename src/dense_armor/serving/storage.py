"""Where the `Server`'s slots keep their caches: a whole fixed cache per slot (`FixedSlots`), or
pages of one shared pool per layer (`serving.paged_slots.PagedSlots`, `nn.state.paged`), with
prefix sharing.

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
import numpy as np

from ..nn.layers.language import ids_checked
from ..nn.models.language_model import TransformerLM
from ..nn.penalties import Penalties
from ..nn.sharding import shard_caches
from .compiled import (
    admit_rows,
    compile_now,
    first_tokens,
    fresh_rows,
    prefill,
    prefill_rows,
    prefill_scored,
    put_row,
    row_of,
    tick,
    tick_rows,
)
from .history import Penalised
from .scoring import PromptScores, Scores, scored_prefill, spread

__all__ = ["Draw", "FixedSlots", "bucket", "prefill_pieces"]


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
        top: int | None, mesh: Any = None,
    ) -> None:  # fmt: skip
        """(`top`: the alternatives scored, None: no request asks for scores; `mesh`: where the
        caches lie, `nn.sharding.shard_caches`.)"""
        self.model, self.slots, self.chunk, self.top = model, slots, chunk, top or 0
        self.capacity, self.kv_dtype = capacity, kv_dtype
        self.prompt_scores: dict[int, PromptScores] = {}  # by slot, until the engine takes them
        caches = model.init_streams(slots, capacity, on_overflow="nan", kv_dtype=kv_dtype)
        self.caches = shard_caches(caches, mesh)
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

    def warm(
        self, arrays: tuple[np.ndarray, ...], shape: tuple[int, int], length: int,
        threads: int | None = None,
    ) -> None:  # fmt: skip
        """Compile now, `threads` at a time (`compile_now`), what the warm-up's requests (of
        `length` tokens and twice that, in batches of every power of two) will run: the
        batched prefill of every piece of every batch size, a longer prompt's rest, the
        admission, the first draw and the tick. Nothing runs but the empty streams' making
        (`fresh_rows`, one per batch size); the requests then find every executable compiled
        (`arrays`: the tick's arrays of idle slots)."""
        calls: list[tuple[Any, tuple[Any, ...]]] = []
        sizes = sorted(set(prefill_pieces(length, self.chunk)))
        for count in sorted({bucket(k, self.slots) for k in range(1, self.slots + 1)}):
            rows = fresh_rows(self.model, count, self.capacity, self.kv_dtype)
            one = row_of(rows, np.int32(0))
            ids = [np.zeros((count, size), np.int32) for size in sizes]
            calls += [(prefill_rows, ((self.model, piece), rows)) for piece in ids]
            if count == 1:  # one row's prefill (a longer prompt's rest): the same at any count
                calls += [(prefill, ((self.model, piece[0]), one)) for piece in ids]
            calls += [(row_of, (rows, np.int32(0))), (put_row, ((one, np.int32(0)), rows))]
            calls += [(admit_rows, ((np.zeros(count, np.int32), np.int32(count), rows),
                                    self.caches))]  # fmt: skip
            calls += [self._first_call(count, rows), self._tick_call(count, arrays, shape)]
        with ids_checked():
            compile_now(calls, threads)

    def _first_call(self, count: int, rows: Any) -> tuple[Any, tuple[Any, ...]]:
        """`first_tokens`' call for `count` requests (`_first_tokens`' arguments' kinds)."""
        hidden = eqx.filter_eval_shape(
            prefill_rows, (self.model, np.zeros((count, 1), np.int32)), rows
        )[0]
        last = np.zeros(hidden.shape, hidden.dtype)
        zeros = lambda dtype: np.zeros(count, dtype)  # noqa: E731
        rules = (zeros(np.float32), zeros(np.int32), np.ones(count, np.float32), zeros(np.float32))
        return first_tokens, (
            self.model, self.penalised.past, self.top, zeros(np.int32), last,
            np.zeros((count, 2), np.uint32), zeros(np.int32), *rules, zeros(bool),
        )  # fmt: skip

    def _tick_call(
        self, count: int, arrays: tuple[np.ndarray, ...], shape: tuple[int, int]
    ) -> tuple[Any, tuple[Any, ...]]:
        """`tick`'s call for `count` busy slots, as `tick` makes it."""
        state = (self.caches, self.penalised.past)
        if self._every_slot(count):
            return tick, (self.model, state, shape, *arrays)
        rows = np.arange(count, dtype=np.int32)
        return tick_rows, (self.model, state, shape, rows, *(a[rows] for a in arrays))

    def _every_slot(self, count: int) -> bool:
        """Whether a tick of `count` busy slots steps every slot (see `tick`)."""
        return count == self.slots or 2 * count * self._slot_bytes > self._weight_bytes

    def tick(self, arrays: tuple[np.ndarray, ...], busy: list[int], shape: tuple[int, int]) -> Any:
        """`steps` steps of the busy slots (`shape`: `(steps, top)`; padded with idle ones to a
        power of two: one busy slot of 8 costs a batch of 1, not 8), their caches taken out and
        put back; every slot's steps in place when most are busy, or when moving the busy
        slots' caches would move more bytes than a step reads of the weights (a long capacity).
        The tokens `(steps, slots)` and their scores (`Ticked`)."""
        count = bucket(len(busy), self.slots)
        with ids_checked():  # prompts were checked by `submit`; the rest are sampled ids
            state = (self.caches, self.penalised.past)
            if self._every_slot(count):
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
