"""The serving engine's records: a request's sampling rules, what it yields (`Event`,
`Completion`), its own state in the queue and in a slot, and the queue's refusal."""

import dataclasses
from typing import Any

import numpy as np

from ..nn.penalties import Penalties
from ..nn.sampling import check_sampling

__all__ = ["Completion", "Event", "QueueFull", "Sampling"]


class QueueFull(RuntimeError):
    """`Server.submit` on a queue holding `max_queue` requests already."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A request's sampling rules (`sample`'s): `temperature` (0: greedy), `top_k`, `top_p`,
    `min_p` (each `None` for off), and its `penalties` (`nn.penalties.Penalties`, applied before
    them; None for none). Checked when made (the penalties' token ids when submitted)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    penalties: Penalties | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)

    def row(self) -> tuple[float, int, float, float]:
        """The rules as one row of the tick's arrays (off: top-k 0, top-p 1, min-p 0; a top-k
        past int32's range keeps every token, as any top-k past the vocabulary does)."""
        k, p, m = self.top_k, self.top_p, self.min_p
        return (
            float(self.temperature), 0 if k is None else min(int(k), 2**31 - 1),
            1.0 if p is None else float(p), 0.0 if m is None else float(m),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: `id` (its number in the order of submission, unless one was given),
    `prompt` and the new `tokens` (int32 arrays), `reason` ("stop": it generated a stop token,
    the last of `tokens`; "length": `max_new_tokens` of them), its timings in
    `time.perf_counter()` seconds, `cached_tokens` (its prompt's tokens found in shared pages,
    not computed again) and `preempted` (how many times it gave its pages back and was
    recomputed; a paged server's only). A request that asked for its scores (`logprobs`) has
    each new token's log-probability under the model `logprobs (n,)`, and its `k` most likely
    alternatives at each step, `top_ids` and `top_logprobs (n, k)` (most likely first); one that
    asked for its prompt's too, `prompt_logprobs (m,)`, `prompt_top_ids` and
    `prompt_top_logprobs (m, k)`, each prompt token's after those before it (the first's NaN,
    its ids -1)."""

    id: Any
    number: int
    prompt: np.ndarray
    tokens: np.ndarray
    reason: str
    submitted: float
    admitted: float
    first_token: float
    finished: float
    cached_tokens: int = 0
    preempted: int = 0
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt_logprobs: np.ndarray | None = None
    prompt_top_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None

    @property
    def time_to_first_token(self) -> float:
        """Seconds from submission to the first new token (the wait for a slot included)."""
        return self.first_token - self.submitted

    @property
    def latency(self) -> float:
        """Seconds from submission to the last token."""
        return self.finished - self.submitted


@dataclasses.dataclass
class _Request:
    id: Any
    number: int
    prompt: np.ndarray
    max_new_tokens: int
    submitted: float
    rules: tuple[float, int, float, float]
    key: np.ndarray  # (2,) uint32: the request's key data, `fold_in`ed with each position
    stop_tokens: frozenset[int]
    logprobs: int | None = None  # alternatives wanted with each token's score (None: no score)
    prompt_logprobs: bool = False  # the prompt's scores too
    penalties: Penalties = dataclasses.field(default_factory=Penalties)
    constraint: Any = None  # a `grammar.Constraint` on its tokens, or None


@dataclasses.dataclass
class _Slot:
    """A slot's request and where it stands: `fed` of its prompt's tokens are in the cache, then
    `tokens` it generated; `cached` prompt tokens were found in shared pages at its first
    admission; `preempted` times it gave its slot back (it then waits in the queue, this record
    kept, until its tokens are recomputed into a slot)."""

    request: _Request
    fed: int
    admitted: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token: float = 0.0
    cached: int = 0
    preempted: int = 0
    scores: list[Any] = dataclasses.field(default_factory=list)  # each token's, if wanted
    prompt_scores: Any = None  # the prompt's (`scoring.PromptScores`), if wanted

    def context(self) -> np.ndarray:
        """Its prompt and the tokens it generated: what a slot must hold for it to go on."""
        return np.concatenate([self.request.prompt, np.asarray(self.tokens, np.int32)])

    def position(self) -> int:
        """The position of the token that its next tick feeds."""
        return self.fed if self.fed < len(self.request.prompt) else self.fed + len(self.tokens) - 1


@dataclasses.dataclass(frozen=True)
class Event:
    """What one `step` produced for a request: its new `token`, and its `completion` when the
    token ended it (else None); `cached_tokens`: its prompt's tokens found in shared pages;
    `logprob` and `top` (its alternatives' `(id, logprob)`, most likely first) if its request
    asked for its scores."""

    id: Any
    token: int
    completion: Completion | None
    cached_tokens: int = 0
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    prompt: Any = None  # the first event's: its prompt's scores (`scoring.PromptScores`) if asked


def tick_arrays(active: list["_Slot | None"]) -> tuple[np.ndarray, ...]:
    """The tick's arrays: each slot's token, the position of the token its logits choose,
    its key and its rules (an idle slot steps on token 0, greedy; its output is unused)."""
    slots = len(active)
    tokens, positions = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
    keys = np.zeros((slots, 2), np.uint32)
    rules = np.zeros((slots, 4), np.float64)
    rules[:, 2] = 1.0
    wanted = np.zeros(slots, bool)
    for i, slot in enumerate(active):
        if slot is None:
            continue
        r = slot.request
        feeding = slot.fed < len(r.prompt)  # still feeding its prompt
        tokens[i] = r.prompt[slot.fed] if feeding else slot.tokens[-1]
        positions[i] = slot.position() + 1
        keys[i], rules[i], wanted[i] = r.key, r.rules, r.logprobs is not None
    return (  # NumPy arrays: a jitted function takes them with no conversion of its own
        tokens, positions, keys, rules[:, 0].astype(np.float32),
        rules[:, 1].astype(np.int32), rules[:, 2].astype(np.float32),
        rules[:, 3].astype(np.float32), wanted,
    )  # fmt: skip


def completion(slot: _Slot, reason: str, now: float) -> Completion:
    """A finished request's `Completion` from its slot's record."""
    r = slot.request
    scored: dict[str, Any] = {}
    if r.logprobs is not None:
        k, scores = r.logprobs, slot.scores
        scored = dict(
            logprobs=np.array([s.logprob for s in scores], np.float32),
            top_ids=np.array([s.ids[:k] for s in scores], np.int32).reshape(len(scores), k),
            top_logprobs=np.array([s.values[:k] for s in scores], np.float32).reshape(
                len(scores), k
            ),
        )  # fmt: skip
    if slot.prompt_scores is not None:
        own, ids, values = slot.prompt_scores
        k = r.logprobs or 0
        scored.update(
            prompt_logprobs=own, prompt_top_ids=ids[:, :k], prompt_top_logprobs=values[:, :k]
        )
    return Completion(
        r.id, r.number, r.prompt, np.array(slot.tokens, np.int32), reason, r.submitted,
        slot.admitted, slot.first_token, now, slot.cached, slot.preempted, **scored,
    )  # fmt: skip
