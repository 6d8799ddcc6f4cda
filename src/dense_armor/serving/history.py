"""Every slot's penalties' history on the device (`nn.penalties.History`), kept by the slots'
storage: a slot's row set when a request is admitted into it, by two compiled calls that
`warm_up` compiles."""

from typing import Any

import equinox as eqx
import numpy as np

from ..nn.penalties import History, Penalties, history, history_row

__all__ = ["Penalised", "history_off", "set_history"]


@eqx.filter_jit(donate="all-except-first")
def set_history(row: tuple[Any, ...], past: History, slot: Any) -> History:
    """`past` with slot `slot`'s row replaced by `row` (`nn.penalties.history_row`'s), in place."""
    return History(*(a.at[slot].set(r) for a, r in zip(past, row, strict=True)))


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

    def warm(self) -> None:
        """Compile the two calls that set a row (slot 0's, left off)."""
        row = history_row(Penalties(), self.vocab, [])
        self.past = set_history(row, self.past, np.int32(0))
        self.past = history_off(None, self.past, np.int32(0))
        self.on.discard(0)
