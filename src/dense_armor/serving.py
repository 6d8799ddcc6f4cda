"""Continuous batching: many generation requests sharing one batch of cache slots.

A `Server` holds `slots` streams of a `TransformerLM` (`init_streams(slots, capacity)`) and a
queue of requests. Each `tick` is one compiled batched `step` of every slot with the sampling in
the graph; a slot whose request finished is `reset` to the next request's prompt, prefilled in
chunks of `chunk` tokens into a fresh cache, while the other slots keep decoding. Every function
compiles once, at the first request (the prefill for a chunk of `chunk` tokens, the admission of a
prefilled cache into a slot, the tick), whatever the prompts' lengths and the order of arrival.

A request leaves as a `Completion`: its new tokens, why it ended, and its timings (submitted,
admitted to a slot, first token, finished; `time.perf_counter()` seconds).

Each request is its own stream: its greedy tokens are those of `generate([prompt], ...)`. A
sampled token of request `n` (its number in the order of submission) at position `p` is drawn
with `fold_in(fold_in(key, n), p)`, so the tokens do not depend on the slot, on the other
requests or on when they arrived: request `n` draws as row `n` of `generate` with the same key.
"""

import collections
import dataclasses
import functools
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .nn.core import require_int, require_key
from .nn.layers.language import ids_checked
from .nn.models.generation import _prompts, check_kv_dtype, check_stop_tokens
from .nn.models.language_model import TransformerLM
from .nn.sampling import check_sampling, draw_tokens
from .nn.state.streams import reset

__all__ = ["Completion", "Server", "read_requests"]


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: `id` (its number in the order of submission, unless one was given),
    `prompt` and the new `tokens` (int32 arrays), `reason` ("stop": it generated a stop token,
    the last of `tokens`; "length": `max_new_tokens` of them), and its timings in
    `time.perf_counter()` seconds."""

    id: Any
    number: int
    prompt: np.ndarray
    tokens: np.ndarray
    reason: str
    submitted: float
    admitted: float
    first_token: float
    finished: float

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


@dataclasses.dataclass
class _Slot:
    """A slot's request and where it stands: `fed` of its prompt's tokens are in the cache, then
    `tokens` it generated."""

    request: _Request
    fed: int
    admitted: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token: float = 0.0


class Server:
    """Continuous batching of generation requests over `slots` cache slots.

    **Arguments:** `model` (a `TransformerLM`), `slots` (streams decoded together, default 8),
    `capacity` (cache slots per stream: a request's prompt and new tokens must fit; default the
    learned positions' `max_len`, else 256), `key` (needed unless `temperature=0`), the sampling
    rules of `generate` (`temperature`, `top_k`, `top_p`, `min_p`), `stop_tokens`, `chunk`
    (the prefill's chunk of prompt tokens, default 16: a prompt's whole chunks go through one
    compiled `prefill` each, the rest through the ticks) and `kv_dtype` (the caches' keys and
    values in another dtype, `"int8"` for a quarter of float32's memory: see
    `TransformerLM.init_cache`).

    `submit(prompt, max_new_tokens)` queues a request; `run()` serves the queue, yielding each
    `Completion` as it finishes; `serve(requests)` does both for `(prompt, max_new_tokens)`
    pairs and returns the completions in the order of submission.
    """

    def __init__(
        self,
        model: TransformerLM,
        slots: int = 8,
        capacity: int | None = None,
        key: jax.Array | None = None,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        stop_tokens: Sequence[int] = (),
        chunk: int = 16,
        kv_dtype: str | None = None,
    ) -> None:
        if not isinstance(model, TransformerLM):
            raise TypeError(
                f"Server: `model` must be a TransformerLM; received {type(model).__name__}."
            )
        require_int(1, caller="Server", slots=slots, chunk=chunk)
        end = model.positions_end
        capacity = (end or 256) if capacity is None else capacity
        require_int(1, caller="Server", capacity=capacity)
        if end is not None and capacity > end:
            raise ValueError(
                f"Server: `capacity={capacity}` passes the model's positions, which end at {end} "
                "(its learned positions' max_len, or LongRoPE's pretrained length)."
            )
        check_sampling(temperature, top_k, top_p, min_p)
        check_kv_dtype("Server", kv_dtype)
        if temperature != 0:
            require_key(key)
        self.kv_dtype = kv_dtype
        self.model, self.slots, self.capacity, self.chunk = (
            model,
            int(slots),
            int(capacity),
            int(chunk),
        )
        self.stop_tokens = check_stop_tokens("Server", model, stop_tokens)
        self.key = jax.random.PRNGKey(0) if key is None else key
        self._tick = _ticker(float(temperature), top_k, top_p, min_p)
        self._queue: collections.deque[_Request] = collections.deque()
        self._submitted = 0
        self._caches: Any = None
        self._fresh: Any = None

    def submit(self, prompt: Sequence[int], max_new_tokens: int, id: Any = None) -> Any:
        """Queue a request; its `id` (default: its number in the order of submission)."""
        (padded,), lengths = _prompts(self.model, [prompt], caller="Server.submit")
        require_int(1, caller="Server.submit", max_new_tokens=max_new_tokens)
        needed = int(lengths[0]) + int(max_new_tokens)
        if needed > self.capacity:
            raise ValueError(
                f"Server.submit: the prompt ({int(lengths[0])} tokens) and `max_new_tokens="
                f"{max_new_tokens}` need {needed} cache slots; each slot holds "
                f"capacity={self.capacity}."
            )
        number = self._submitted
        self._submitted += 1
        request = _Request(
            number if id is None else id, number, padded, int(max_new_tokens), time.perf_counter()
        )
        self._queue.append(request)
        return request.id

    @property
    def pending(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    def serve(self, requests: Iterable[tuple[Sequence[int], int]]) -> list[Completion]:
        """Submit `(prompt, max_new_tokens)` pairs, serve them all: their completions in the
        order of submission."""
        numbers = [self.submit(prompt, n) for prompt, n in requests]
        done = {c.id: c for c in self.run()}
        return [done[n] for n in numbers]

    def run(self) -> Iterator[Completion]:
        """Serve the queue until it is empty and every slot idle, yielding each `Completion` as
        it finishes. Requests submitted meanwhile (from another thread, or between two
        completions) join the batch as slots free up."""
        if not self._queue:
            raise ValueError(
                "Server.run: the queue is empty; `submit` requests (prompt, max_new_tokens) first."
            )
        model, slots = self.model, self.slots
        if self._caches is None:
            kv = self.kv_dtype
            self._fresh = model.init_cache(self.capacity, on_overflow="nan", kv_dtype=kv)
            self._caches = model.init_streams(slots, self.capacity, on_overflow="nan", kv_dtype=kv)
        active: list[_Slot | None] = [None] * slots
        tokens = np.zeros(slots, np.int32)
        positions = np.zeros(slots, np.int32)
        numbers = np.zeros(slots, np.int32)
        while self._queue or any(s is not None for s in active):
            for i in range(slots):
                if active[i] is None and self._queue:
                    active[i] = self._admit(i, self._queue.popleft())
            for i, slot in enumerate(active):
                # the token each slot feeds, and the position of the token its logits choose
                if slot is None:  # an idle slot steps on token 0; its output is unused
                    tokens[i], positions[i], numbers[i] = 0, 0, 0
                elif slot.fed < len(slot.request.prompt):  # still feeding its prompt
                    tokens[i], positions[i] = slot.request.prompt[slot.fed], slot.fed + 1
                    numbers[i] = slot.request.number
                else:
                    tokens[i], positions[i] = slot.tokens[-1], slot.fed + len(slot.tokens)
                    numbers[i] = slot.request.number
            with ids_checked():  # prompts were checked by `submit`; the rest are sampled ids
                chosen, self._caches = self._tick(
                    (model, self.key), self._caches, jnp.asarray(tokens),
                    jnp.asarray(positions), jnp.asarray(numbers),
                )  # fmt: skip
            chosen = np.asarray(chosen)
            now = time.perf_counter()
            for i, slot in enumerate(active):
                if slot is None:
                    continue
                if slot.fed < len(slot.request.prompt):
                    slot.fed += 1
                    if slot.fed < len(slot.request.prompt):
                        continue  # the logits of a prompt token that another one follows
                if not slot.tokens:
                    slot.first_token = now
                slot.tokens.append(int(chosen[i]))
                stopped = slot.tokens[-1] in self.stop_tokens
                if stopped or len(slot.tokens) == slot.request.max_new_tokens:
                    active[i] = None
                    yield self._completion(slot, "stop" if stopped else "length", now)

    def _admit(self, i: int, request: _Request) -> _Slot:
        """Slot `i` reset to `request`'s prompt: its whole chunks but the last token prefilled
        into a fresh cache (the ticks feed the rest, the last token's logits giving the first
        new token)."""
        admitted = time.perf_counter()
        prompt, chunk = request.prompt, self.chunk
        whole = (len(prompt) - 1) // chunk
        cache = self._fresh
        for c in range(whole):
            with ids_checked():  # checked by `submit`
                cache = _prefill(
                    self.model, jnp.asarray(prompt[c * chunk : (c + 1) * chunk]), cache
                )
        self._caches = _admit((jnp.arange(self.slots) == i, cache), self._caches)
        return _Slot(request, whole * chunk, admitted)

    def _completion(self, slot: _Slot, reason: str, now: float) -> Completion:
        r = slot.request
        return Completion(
            r.id, r.number, r.prompt, np.array(slot.tokens, np.int32), reason, r.submitted,
            slot.admitted, slot.first_token, now,
        )  # fmt: skip


@eqx.filter_jit
def _prefill(model: TransformerLM, ids: jax.Array, cache: Any) -> Any:
    return model.prefill(ids, cache)[1]


@eqx.filter_jit(donate="all-except-first")
def _admit(new: tuple[jax.Array, Any], caches: Any) -> Any:
    """`caches` with the slots where `chosen` is true replaced by `cache` (`new`); the old
    caches' buffers donated, so the slots' memory is updated in place."""
    chosen, cache = new
    return reset(caches, chosen, cache)


@functools.cache
def _ticker(temperature: float, top_k: int | None, top_p: float | None, min_p: float | None) -> Any:
    """The compiled tick for these sampling rules: every slot's `step` on its token, and the
    token each slot's logits choose (request `n` at position `p`: `fold_in(fold_in(key, n), p)`)."""

    @eqx.filter_jit(donate="all-except-first")  # the caches are updated in place
    def tick(
        model_and_key: tuple[TransformerLM, jax.Array],
        caches: Any,
        tokens: jax.Array,
        positions: jax.Array,
        numbers: jax.Array,
    ) -> tuple[jax.Array, Any]:
        model, key = model_and_key
        logits, caches = jax.vmap(model.step)(tokens, caches)
        chosen = draw_tokens(
            logits, key, numbers, positions, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p,
        )  # fmt: skip
        return chosen, caches

    return tick


def read_requests(
    lines: Sequence[str], tokenizer: Any, default_new: int, where: str
) -> list[dict[str, Any]]:
    """`dense-armor serve`'s requests from the lines of its input (blank lines skipped): a line
    of text (encoded with `tokenizer`), or a JSON object `{"prompt": TEXT}` or `{"ids": [...]}`
    with `"max_new_tokens"` (default `default_new`) and `"id"` if wanted; `{"ids", "max_new",
    "id"}` each. A malformed line is a `ValueError` naming `where` and the line."""
    requests: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        text = line.rstrip("\n")
        entry: dict[str, Any] = {"prompt": text}
        if text.lstrip().startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} line {number}: not a JSON object ({error}).") from None
            if not isinstance(entry, dict) or ("prompt" in entry) == ("ids" in entry):
                raise ValueError(
                    f'{where} line {number}: a JSON request holds "prompt" (text) or "ids" '
                    "(token ids), one of them."
                )
        if "ids" in entry:
            ids = entry["ids"]
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise ValueError(f'{where} line {number}: "ids" must be a list of integers.')
        elif tokenizer is None:
            raise ValueError(
                f"{where} line {number}: a text prompt needs a tokenizer: pass --tokenizer "
                '(or give token ids, {"ids": [...]}).'
            )
        else:
            ids = tokenizer.encode(str(entry["prompt"])).ids
        new = entry.get("max_new_tokens", default_new)
        if not isinstance(new, int) or isinstance(new, bool) or new < 1:
            raise ValueError(f'{where} line {number}: "max_new_tokens" must be an integer >= 1.')
        requests.append({"ids": ids, "max_new": new, "id": entry.get("id", len(requests))})
    if not requests:
        raise ValueError(f"{where} holds no request: nothing to serve.")
    return requests
