"""Every slot's penalties' history on the device (`nn.penalties.History`), kept by the slots'
storage: a slot's row set when a request is admitted into it, by two compiled calls that
`warm_up` compiles."""

import functools
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..nn.penalties import History, Penalties, history, history_row, mask_words
from ..nn.sharding import laid_out

__all__ = ["Penalised", "history_off", "set_history", "set_masks"]


@eqx.filter_jit(donate="all-except-first")
@laid_out
def set_history(row: tuple[Any, ...], past: History, slot: Any) -> History:
    """`past` with slot `slot`'s penalties replaced by `row` (`nn.penalties.history_row`'s), in
    place."""
    counts, seen, bias, settings, active = (
        a.at[slot].set(r) for a, r in zip(past[:5], row, strict=True)
    )
    return past._replace(counts=counts, seen=seen, bias=bias, settings=settings, active=active)


@functools.partial(jax.jit, donate_argnums=1)  # jax.jit's dispatch: a call every round
@laid_out
def set_masks(masks: tuple[Any, Any], past: History) -> History:
    """`past` with every slot's grammar mask replaced by `masks` (the words `(S, W)`, and which
    slots have one `(S,)`), in place."""
    words, on = masks
    return past._replace(allowed=words, masked=on)


@eqx.filter_jit(donate="all-except-first")
@laid_out
def history_off(_: Any, past: History, slot: Any) -> History:
    """`past` with slot `slot`'s penalties off, in place."""
    return past._replace(active=past.active.at[slot].set(False))


class Penalised:
    """Every slot's penalties' history on the device (`past`, an `nn.penalties.History`), a
    slot's row set when a request is admitted into it, from its context (a preempted request's
    output counted again); `on`, the slots whose row is on (the host's record: a request
    without penalties in a slot without them costs no call). The grammar masks are kept on the
    host (`words`, `masked`) as requests advance, and sent in one call when `past` is next read
    (a round's masks of every slot at once)."""

    def __init__(self, slots: int, vocab: int) -> None:
        self._past, self.vocab, self.on = history(slots, vocab), vocab, set[int]()
        self.words = np.full((slots, mask_words(vocab)), -1, np.int32)  # all tokens allowed
        self.masked = np.zeros(slots, bool)
        self._stale = False  # the host's masks not yet sent

    @property
    def past(self) -> History:
        """The history on the device, with the host's latest masks."""
        if self._stale:
            self._past = set_masks((self.words, self.masked), self._past)
            self._stale = False
        return self._past

    @past.setter
    def past(self, value: History) -> None:
        self._past = value

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
        self.constrain(i, draw.constraint)

    def constrain(self, i: int, constraint: Any) -> None:
        """Slot `i`'s grammar mask: that of `constraint`'s next token (`grammar.Constraint.fill`),
        or none (`None`; a slot that had none costs nothing)."""
        if constraint is not None:
            constraint.fill(self.words[i])
            self.masked[i] = self._stale = True
        elif self.masked[i]:
            self.words[i], self.masked[i], self._stale = -1, False, True

    def warm(self) -> None:
        """Compile the calls that set a row (slot 0's, left off)."""
        row = history_row(Penalties(), self.vocab, [])
        self.past = set_history(row, self.past, np.int32(0))
        self.past = history_off(None, self.past, np.int32(0))
        self.on.discard(0)
        self._stale = True
        _ = self.past  # the call that sends the masks
