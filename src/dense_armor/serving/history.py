"""Every slot's penalties' history on the device (`nn.penalties.History`), kept by the slots'
storage: a slot's row set when a request is admitted into it, by two compiled calls that
`warm_up` compiles."""

from typing import Any

import equinox as eqx
import numpy as np

from ..nn.penalties import History, Penalties, history, history_row, mask_words

__all__ = ["Penalised", "history_off", "set_history", "set_mask"]


@eqx.filter_jit(donate="all-except-first")
def set_history(row: tuple[Any, ...], past: History, slot: Any) -> History:
    """`past` with slot `slot`'s penalties replaced by `row` (`nn.penalties.history_row`'s), in
    place."""
    counts, seen, bias, settings, active = (
        a.at[slot].set(r) for a, r in zip(past[:5], row, strict=True)
    )
    return past._replace(counts=counts, seen=seen, bias=bias, settings=settings, active=active)


@eqx.filter_jit(donate="all-except-first")
def set_mask(row: tuple[Any, Any], past: History, slot: Any) -> History:
    """`past` with slot `slot`'s grammar mask replaced by `row` (its words, and whether it has
    one), in place."""
    words, on = row
    assert past.allowed is not None and past.masked is not None
    return past._replace(
        allowed=past.allowed.at[slot].set(words), masked=past.masked.at[slot].set(on)
    )


@eqx.filter_jit(donate="all-except-first")
def history_off(_: Any, past: History, slot: Any) -> History:
    """`past` with slot `slot`'s penalties off, in place."""
    return past._replace(active=past.active.at[slot].set(False))


class Penalised:
    """Every slot's penalties' history on the device (`past`, an `nn.penalties.History`), a
    slot's row set when a request is admitted into it, from its context (a preempted request's
    output counted again); `on`, the slots whose row is on (the host's record: a request
    without penalties in a slot without them costs no call)."""

    def __init__(self, slots: int, vocab: int) -> None:
        self.past, self.vocab, self.on = history(slots, vocab), vocab, set[int]()
        self.masks = set[int]()  # the slots whose grammar mask is on
        self._all = np.full(mask_words(vocab), -1, np.int32)  # every token allowed

    def admit(self, i: int, context: np.ndarray, draw: Any) -> None:
        """Slot `i`'s row for a request of `context` (`draw`: its `storage.Draw`, its penalties
        and its prompt's length)."""
        if draw.penalties.on:
            self.on.add(i)
            prompt, output = context[: draw.prompt], context[draw.prompt :]
            row = history_row(draw.penalties, self.vocab, prompt, output)
            self.past = set_history(row, self.past, np.int32(i))
        elif i in self.on:
            self.on.discard(i)
            self.past = history_off(None, self.past, np.int32(i))
        self.constrain(i, None if draw.constraint is None else self.mask(draw.constraint))

    def mask(self, constraint: Any) -> np.ndarray:
        """The words of `constraint`'s mask of its next token (`grammar.Constraint.fill`)."""
        words = np.empty(mask_words(self.vocab), np.int32)
        constraint.fill(words)
        return words

    def constrain(self, i: int, words: np.ndarray | None) -> None:
        """Slot `i`'s grammar mask: `words` (int32, `mask_words(vocab)` of them) for its next
        token, or `None`: none (only a slot that had one costs a call)."""
        if words is not None:
            self.masks.add(i)
            self.past = set_mask((words, np.True_), self.past, np.int32(i))
        elif i in self.masks:
            self.masks.discard(i)
            self.past = set_mask((self._all, np.False_), self.past, np.int32(i))

    def warm(self) -> None:
        """Compile the calls that set a row (slot 0's, left off)."""
        row = history_row(Penalties(), self.vocab, [])
        self.past = set_history(row, self.past, np.int32(0))
        self.past = history_off(None, self.past, np.int32(0))
        self.on.discard(0)
        self.constrain(0, self._all)
        self.constrain(0, None)
