"""The scores a request may ask for: each token's log-probability under the model and its most
likely alternatives (`Scores`), a tick's for every slot (`Ticked`), and a prompt's, computed
by the prefill of a request that asks (`PromptScores`, `scored_prefill`)."""

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = ["PromptScores", "Scores", "Ticked", "scored_prefill", "spread"]


class Scores(NamedTuple):
    """A token's log-probability under the model and its `top` alternatives' (ids and
    log-probabilities, most likely first)."""

    logprob: float
    ids: np.ndarray
    values: np.ndarray


class Ticked(NamedTuple):
    """A tick's tokens `(steps, slots)` and their scores: log-probabilities `(steps, slots)`,
    the alternatives' ids and log-probabilities `(steps, slots, top)`."""

    tokens: np.ndarray
    logprobs: np.ndarray
    ids: np.ndarray
    values: np.ndarray

    def scores(self, step: int, slot: int) -> Scores:
        return Scores(
            float(self.logprobs[step, slot]), self.ids[step, slot], self.values[step, slot]
        )


def spread(ticked: Any, rows: np.ndarray, slots: int) -> Ticked:
    """A tick's results for the slots `rows` as a `Ticked` of every slot (the others zeros)."""
    tokens, (own, ids, values) = ticked
    parts = []
    for a in (tokens, own, ids, values):
        a = np.asarray(a)
        whole = np.zeros((a.shape[0], slots, *a.shape[2:]), a.dtype)
        whole[:, rows] = a
        parts.append(whole)
    return Ticked(*parts)


class PromptScores(NamedTuple):
    """A prompt's scores: each token's log-probability after those before it `logprobs (n,)`
    and the `top` alternatives at its place `ids`, `values (n, top)`; the first token has none
    (NaN, ids -1)."""

    logprobs: np.ndarray
    ids: np.ndarray
    values: np.ndarray


def scored_prefill(
    run: Callable[[np.ndarray, np.ndarray, Any], tuple[Any, Any, Any]],
    context: np.ndarray,
    pieces: list[int],
    state: Any,
    top: int,
) -> tuple[Any, Any, PromptScores]:
    """`run(piece, following, state) -> (result, state, scores)` over the `pieces` of `context`
    (`following`: the token after each of the piece's, 0 past the context's end): the last
    result, the state, and the scores of the tokens the pieces' positions precede (all of the
    context's but the first, as far as the pieces reach)."""
    start, result, parts = 0, None, []  # parts: each piece's (logprobs, ids, values)
    following = np.concatenate([np.asarray(context[1:], np.int32), np.zeros(1, np.int32)])
    for size in pieces:
        result, state, scores = run(
            context[start : start + size], following[start : start + size], state
        )
        parts.append([np.asarray(a) for a in scores])
        start += size
    n = len(context)
    own = np.full(n, np.nan, np.float32)
    ids, values = np.full((n, top), -1, np.int32), np.full((n, top), np.nan, np.float32)
    if parts:
        got = [np.concatenate(a)[: n - 1] for a in zip(*parts, strict=True)]
        m = len(got[0])
        own[1 : 1 + m], ids[1 : 1 + m], values[1 : 1 + m] = got[0], got[1], got[2]
    return result, state, PromptScores(own, ids, values)
