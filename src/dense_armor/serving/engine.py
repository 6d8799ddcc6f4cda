"""The serving engine: continuous batching of generation requests over a batch of cache slots.

A `Server` holds `slots` streams of a `TransformerLM` (`init_streams(slots, capacity)`) and a queue
of requests. Each `tick` is one compiled call of `decode_steps` batched `step`s of every busy slot
with the sampling in the graph, each slot with its own rules and key (arrays: one compilation
whatever the mix of requests), and each token's scores when a request asks; a slot whose request
finished is `reset` to the next request's prompt, prefilled in chunks of `chunk` tokens and pieces
of halving sizes into a fresh cache, while the other slots keep decoding. The requests admitted in
one round are prefilled together (one batch per piece), and with fixed slots each one's first token
is drawn from its prefill and returned before the next tick; a tick steps the busy slots only
(padded to a power of two). Every function compiles once per piece size and power of two of
requests (`warm_up` compiles them all), whatever the prompts' lengths and the order of arrival.

`step()` runs one round (admissions, a tick) and returns what it produced: each request's new
token, and its `Completion` when it finished (its new tokens, why it ended, its timings). `run()`
repeats it until the queue is empty; `cancel(id)` drops a request, queued or in a slot, before
the next tick. `submit` and `cancel` may be called from another thread while one thread steps.

Each request is its own stream: its greedy tokens are those of `generate([prompt], ...)`. A
sampled token at position `p` is drawn with `fold_in(request_key, p)`: a request with its own
`key` draws as `generate([prompt], key=key)`; otherwise request `n` (its number in the order of
submission) has `fold_in(key, n)`, the server's key, and draws as row `n` of `generate` with it.
The tokens depend neither on the slot, nor on the other requests, nor on when they arrived.
"""

import collections
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ..nn.core import require_int, require_key
from ..nn.models.generation import _prompts, check_kv_dtype, check_stop_tokens
from ..nn.models.language_model import TransformerLM
from ..nn.penalties import check_penalties
from ..nn.sharding import check_serving_mesh, on_mesh, place_model
from .grammar import Constraint
from .paged_slots import PagedSlots
from .records import (
    Completion,
    Event,
    QueueFull,
    Sampling,
    _Request,
    _Slot,
    completion,
    tick_arrays,
)
from .scoring import Scores, Ticked
from .settings import (
    capacity_of,
    check_room,
    check_scores,
    decode_steps_of,
    key_data,
    paged_attention_of,
    paging,
    request_key,
)
from .storage import Draw, FixedSlots, bucket, prefill_pieces

__all__ = ["Completion", "Event", "QueueFull", "Sampling", "Server", "prefill_pieces"]


class Server:
    """Continuous batching of generation requests over `slots` cache slots.

    **Arguments:** `model` (a `TransformerLM`), `slots` (streams decoded together, default 8),
    `capacity` (cache slots per stream: a request's prompt and new tokens must fit; at most the
    model's `context`, its default, unless `slots` caches of it pass half of the memory left:
    see `settings.capacity_of`), `key` (the requests' keys derive from it unless
    given their own), the default sampling rules of the requests (`temperature`, `top_k`,
    `top_p`, `min_p`, as `generate`'s), `stop_tokens` (every request's), `chunk` (the prefill's
    chunk of prompt tokens, default 16: a prompt's whole chunks go through one compiled
    `prefill` each, the rest in pieces of 8, 4, 2 and 1 tokens; a paged server feeds the last
    one through a tick), `kv_dtype` (the caches' keys and values in another dtype, `"int8"`
    for a quarter of float32's memory: see `TransformerLM.init_cache`), `max_queue` (requests
    waiting for a slot at most; `submit` past it raises `QueueFull`; default unbounded), `pages`,
    `page_size`, `share_prefixes` (a paged cache: one pool of `pages` pages of `page_size`
    positions per layer instead of a whole cache per slot, taken as requests grow, the
    youngest request preempted and recomputed when the pool runs short; full pages of prompt
    tokens shared between requests by default where every state is keys and values; see
    `serving.storage` and `serving.pages`), `paged_attention` (how a paged decoding step reads
    its pages: `"auto"`, the Pallas kernel on a TPU and a gather elsewhere, `"kernel"` or
    `"gather"` everywhere; see `nn.kernels.paged`), `decode_steps` (decoding steps of every busy
    slot per dispatch, the sampled token fed back on the device: the host's round trip paid once
    for that many tokens; a request's tokens come back that many at a time, the steps past its
    end dropped; default 1), `max_logprobs` (requests may ask for their tokens' scores, with up
    to that many alternatives each: computed in the tick only when a request asks, and a
    prompt's by its prefill; default None: no scores), `structured` (requests may carry a
    grammar, `submit(constraint=)`: structured output, see `serving.grammar`; default False),
    `mesh` (a `jax.sharding.Mesh`: the model's heads and hidden units and the caches' key/value
    heads split over its `"model"` axis, as `generate(mesh=)`; see `nn.sharding`).

    `warm_up()` compiles every function serving runs before the first request; `submit(prompt,
    max_new_tokens)` queues a request (its own `sampling`, `key` and
    `stop_tokens` if given); `run()` serves the queue, yielding each `Completion` as it
    finishes; `serve(requests)` does both for `(prompt, max_new_tokens)` pairs and returns the
    completions in the order of submission; `step()` is one round, `cancel(id)` drops a request.
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
        max_queue: int | None = None,
        pages: int | None = None,
        page_size: int = 16,
        share_prefixes: bool | None = None,
        paged_attention: str = "auto",
        decode_steps: int | None = None,
        max_logprobs: int | None = None,
        structured: bool = False,
        mesh: Any = None,
    ) -> None:
        if not isinstance(model, TransformerLM):
            raise TypeError(
                f"Server: `model` must be a TransformerLM; received {type(model).__name__}."
            )
        require_int(1, caller="Server", slots=slots, chunk=chunk)
        if max_queue is not None:
            require_int(0, caller="Server", max_queue=max_queue)
        self.mesh = check_serving_mesh("Server", mesh)
        self.model, self.slots, self.chunk = place_model(model, self.mesh), int(slots), int(chunk)
        check_kv_dtype("Server", kv_dtype)
        self._paging = paging(pages, page_size, share_prefixes)
        self.paged_attention = paged_attention_of(paged_attention)
        self.capacity = capacity_of(model, capacity, slots, kv_dtype, self._paging is not None)
        self.sampling = Sampling(temperature, top_k, top_p, min_p)
        if temperature != 0:
            require_key(key)
        self.kv_dtype, self.max_queue = kv_dtype, max_queue
        self.decode_steps = decode_steps_of(decode_steps)
        if max_logprobs is not None:
            require_int(0, caller="Server", max_logprobs=max_logprobs)
        self.max_logprobs = max_logprobs
        if not isinstance(structured, bool):
            raise TypeError(f"Server: `structured` must be True or False; received {structured!r}.")
        self.structured = structured
        self.stop_tokens = check_stop_tokens("Server", model, stop_tokens)
        self.key = key_data(jax.random.PRNGKey(0) if key is None else key)
        self._queue: collections.deque[_Request] = collections.deque()
        self._lock = threading.Lock()
        self._cancelled: set[Any] = set()
        self._active: list[_Slot | None] = [None] * self.slots
        self._preempted: dict[int, _Slot] = {}  # by request number, waiting in the queue
        self._submitted = 0
        self._store: FixedSlots | PagedSlots | None = None
        self._put_off = False  # the last round returned its first tokens before a tick

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        id: Any = None,
        *,
        sampling: Sampling | None = None,
        key: jax.Array | None = None,
        stop_tokens: Sequence[int] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        constraint: Constraint | None = None,
    ) -> Any:
        """Queue a request; its `id` (default: its number in the order of submission). Its own
        `sampling` rules, `key` (its tokens those of `generate([prompt], key=key)`) and
        `stop_tokens` replace the server's if given; `logprobs` (0 to `max_logprobs`): each new
        token's log-probability under the model and that many alternatives' (`Event.logprob`,
        `Completion.logprobs`) on a server made with `max_logprobs`; `prompt_logprobs` too: each
        prompt token's after those before it (`Completion.prompt_logprobs`; the prompt is then
        computed whole, not taken from shared pages); `constraint` (a `grammar.Constraint`, on a
        server made with `structured=True`): a grammar its tokens follow, the request ended
        when it is complete."""
        (padded,), lengths = _prompts(self.model, [prompt], caller="Server.submit")
        require_int(1, caller="Server.submit", max_new_tokens=max_new_tokens)
        check_room(int(lengths[0]), max_new_tokens, self.capacity, self._paging)
        sampling = self.sampling if sampling is None else sampling
        rules, penalties = sampling.row(), check_penalties(sampling.penalties, self.model.vocab)
        stops = self.stop_tokens if stop_tokens is None else check_stop_tokens(
            "Server.submit", self.model, stop_tokens
        )  # fmt: skip
        if key is not None:
            require_key(key)
        check_scores(logprobs, prompt_logprobs, self.max_logprobs)
        if constraint is not None and not self.structured:
            raise ValueError(
                "Server.submit: a `constraint` needs a server made with `structured=True` (its "
                "warm-up compiles the one-step tick constrained requests decode with)."
            )
        with self._lock:
            if self.max_queue is not None and len(self._queue) >= self.max_queue:
                raise QueueFull(
                    f"Server.submit: {len(self._queue)} requests wait already "
                    f"(max_queue={self.max_queue})."
                )
            number = self._submitted
            self._submitted += 1
            base, index = (self.key, number) if key is None else (key_data(key), 0)
            with on_mesh(self.mesh):  # as in `warm_up`: one compilation
                drawn = np.asarray(request_key(base, index))
            request = _Request(
                number if id is None else id, number, padded, int(max_new_tokens),
                time.perf_counter(), rules, drawn,
                frozenset(stops), logprobs, bool(prompt_logprobs), penalties, constraint,
            )  # fmt: skip
            self._queue.append(request)
        return request.id

    def cancel(self, id: Any) -> None:
        """Drop request `id`, queued or in a slot (freed before the next tick); nothing if it
        finished or is unknown."""
        with self._lock:
            self._cancelled.add(id)

    @property
    def pending(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    @property
    def busy(self) -> int:
        """Slots serving a request."""
        return sum(slot is not None for slot in self._active)

    @property
    def longest_request(self) -> int:
        """The most positions that a request's prompt and new tokens may take: `capacity`, and
        for a paged server the pool's pages too (the last new token is not written)."""
        if self._paging is None:
            return self.capacity
        pages, size, _ = self._paging
        return min(self.capacity, (pages - 1) * size + 1)

    @property
    def pool(self) -> tuple[int, int] | None:
        """A paged server's pages (the null page among them) and positions per page; None for
        fixed slots."""
        return None if self._paging is None else self._paging[:2]

    @property
    def page_counts(self) -> tuple[int, int] | None:
        """A paged server's pages that requests could take and pages held; None for fixed
        slots."""
        if self._paging is None:
            return None
        if not isinstance(self._store, PagedSlots):
            return self._paging[0] - 1, 0  # before the first step: all but the null page
        return self._store.book.available, self._store.book.held

    @property
    def caches(self) -> Any:
        """The slots' caches as they lie on the device(s), for inspection: every slot's whole
        cache, or a paged server's pools (made at the first step, or here)."""
        store = self._slots()
        return store.pools if isinstance(store, PagedSlots) else store.caches

    @property
    def idle(self) -> bool:
        """True when no request waits and no slot is busy."""
        return not self._queue and self.busy == 0

    def serve(self, requests: Iterable[tuple[Sequence[int], int]]) -> list[Completion]:
        """Submit `(prompt, max_new_tokens)` pairs, serve them all: their completions in the
        order of submission."""
        numbers = [self.submit(prompt, n) for prompt, n in requests]
        done = {c.id: c for c in self.run()}
        return [done[n] for n in numbers]

    def warm_up(self, threads: int | None = None) -> None:
        """Compile now what serving will run, so that no request waits for a compilation: every
        prefill piece, the batched prefill and admission of each batch size the slots allow
        (requests admitted in one round are prefilled together), and the tick; a paged server's
        prefill pieces and ticks at every table width too. They compile first, `threads` at a
        time (default `compiled.THREADS` or the machine's cores, the fewer: `FixedSlots.warm`,
        `PagedSlots.warm`); then it serves a few two-token requests of zeros, which find them
        compiled; later requests are numbered as if it had not."""
        if threads is not None:
            require_int(1, caller="Server.warm_up", threads=threads)
        if not self.idle:
            raise ValueError("Server.warm_up: call it before submitting requests.")
        with on_mesh(self.mesh):
            self._warm_up(threads)

    def _warm_up(self, threads: int | None) -> None:
        if self.structured and self.decode_steps > 1:  # the one-step tick of constrained ones
            steps, self.decode_steps = self.decode_steps, 1
            try:
                self._warm(threads)
            finally:
                self.decode_steps = steps
        self._warm(threads)

    def _warm(self, threads: int | None) -> None:
        """`warm_up`'s work at the server's `decode_steps`."""
        # prompts of pieces of every size (chunk, ..., 2, 1), and the longer ones' rests too
        n = min(2 * self.chunk - 1, (self.longest_request - 2) // 2)
        if n < 1:
            return
        store = self._slots()
        if isinstance(store, PagedSlots):  # every table width a longer request reaches, first
            store.warm(tick_arrays(self._active), self._shape, threads)
        else:  # the requests' functions compiled at once, first
            store.warm(tick_arrays(self._active), self._shape, n, threads)
        submitted = self._submitted
        for count in sorted({bucket(k, self.slots) for k in range(1, self.slots + 1)}):
            # two new tokens each: the first drawn from the prefill, the second by a tick
            self.serve([([0] * n, 2)] + [([0] * (2 * n), 2)] * (count - 1))
        if self.max_logprobs is not None:  # prompts scored, in pieces of every size
            for length in (n, n + 1):  # (a paged prefill stops before the last token)
                self.submit([0] * length, 2, logprobs=0, prompt_logprobs=True)
            list(self.run())
        self._submitted = submitted
        store.penalised.warm()  # a request's penalties set into its slot's history

    def run(self) -> Iterator[Completion]:
        """Serve the queue until it is empty and every slot idle, yielding each `Completion` as
        it finishes. Requests submitted meanwhile (from another thread, or between two
        completions) join the batch as slots free up."""
        if self.idle:
            raise ValueError(
                "Server.run: the queue is empty; `submit` requests (prompt, max_new_tokens) first."
            )
        while not self.idle:
            for event in self.step():
                if event.completion is not None:
                    yield event.completion

    def step(self) -> list[Event]:
        """One round: drop cancelled requests, admit queued ones into free slots, one tick of
        every slot. Each request's new token (none for a slot still feeding its prompt) as an
        `Event`, with its `Completion` if it finished. The fixed slots draw an admitted
        request's first token from its prefill: a round that drew some returns them at once and
        leaves its tick to the next round (unless the round before did too: ticks are never
        put off twice in a row, whatever keeps arriving)."""
        with on_mesh(self.mesh):
            return self._step()

    def _step(self) -> list[Event]:
        store = self._slots()
        self._drop_cancelled()
        self._admit(store)
        now = time.perf_counter()
        settled = store.settle().items()
        for i, scores in store.prompt_scores.items():  # before a first token may end it
            self._active[i].prompt_scores = scores  # type: ignore[union-attr]
        store.prompt_scores.clear()
        first = [self._take(i, token, now, scores) for i, (token, scores) in settled]
        if self.busy == 0 or (first and not self._put_off):
            self._put_off = bool(first)
            return first
        self._put_off = False
        self._grow(store)
        busy = [i for i, slot in enumerate(self._active) if slot is not None]
        ticked = store.tick(tick_arrays(self._active), busy, self._shape)
        return first + self._advance(ticked, time.perf_counter())

    @property
    def _shape(self) -> tuple[int, int]:
        """The tick's static shape: decoding steps (one while a constrained request decodes: the
        next step's mask waits for this one's token), and the alternatives scored."""
        constrained = any(s is not None and s.request.constraint for s in self._active)
        return 1 if constrained else self.decode_steps, self.max_logprobs or 0

    def _admit(self, store: FixedSlots | PagedSlots) -> None:
        """Queued requests into the free slots, the oldest first; it waits for pages if it
        must. A preempted request comes back with its tokens, recomputed by the prefill."""
        for i in range(self.slots):
            if self._active[i] is not None:
                continue
            with self._lock:
                if not self._queue:
                    return
                request = self._queue[0]
                slot = self._preempted.get(request.number)
                context = request.prompt if slot is None else slot.context()
                if not store.fits(context):
                    return
                self._queue.popleft()
                self._preempted.pop(request.number, None)
            scored = request.logprobs is not None
            prompt = request.prompt_logprobs and (slot is None or slot.prompt_scores is None)
            draw = Draw(
                request.key, request.rules, scored, prompt, request.penalties,
                len(request.prompt), request.constraint,
            )  # fmt: skip
            start = store.admit(i, context, draw)
            if slot is None:
                slot = _Slot(request, 0, time.perf_counter(), cached=start)
            slot.fed = min(len(context) - 1, len(request.prompt))
            self._active[i] = slot

    def _grow(self, store: FixedSlots | PagedSlots) -> None:
        """Each busy slot's pages for the row its tick writes, the oldest request first; when
        the pool is short, the youngest request is preempted: it gives its pages back and waits
        at the head of the queue to be recomputed (its tokens do not change: each is drawn with
        its key and position). The oldest alone always fits (`submit` refuses a request larger
        than the pool), so every request ends."""
        busy = sorted((s.request.number, i) for i, s in enumerate(self._active) if s is not None)
        for _, i in busy:
            while (slot := self._active[i]) is not None and not store.grow(i, self._rows(slot)):
                running = [(s.request.number, j) for j, s in enumerate(self._active) if s]
                self._preempt(max(running)[1])

    def _rows(self, slot: _Slot) -> int:
        """The positions a slot's request holds after the next tick: the `decode_steps` rows
        the tick writes, up to the last its request writes (its last new token is not)."""
        last = len(slot.request.prompt) + slot.request.max_new_tokens - 1
        return min(slot.position() + self.decode_steps, last)

    def _preempt(self, i: int) -> None:
        slot = self._active[i]
        assert slot is not None
        self._free(i)
        slot.preempted += 1
        with self._lock:
            self._preempted[slot.request.number] = slot
            self._queue.appendleft(slot.request)

    def _slots(self) -> FixedSlots | PagedSlots:
        """The slots' caches, made at the first step."""
        if self._store is None:
            model, slots, capacity, kv, chunk = (
                self.model, self.slots, self.capacity, self.kv_dtype, self.chunk
            )  # fmt: skip
            if self._paging is None:
                self._store = FixedSlots(
                    model, slots, capacity, kv, chunk, self.max_logprobs, self.mesh
                )  # fmt: skip
            else:
                self._store = PagedSlots(
                    model, slots, capacity, kv, chunk, self.max_logprobs, *self._paging,
                    read=self.paged_attention, mesh=self.mesh,
                )  # fmt: skip
        return self._store

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone, self._cancelled = self._cancelled, set()
            if gone:
                self._queue = collections.deque(r for r in self._queue if r.id not in gone)
                self._preempted = {
                    n: s for n, s in self._preempted.items() if s.request.id not in gone
                }  # fmt: skip
        for i, slot in enumerate(self._active):
            if slot is not None and slot.request.id in gone:
                self._free(i)

    def _free(self, i: int) -> None:
        """Slot `i` given back; the rows its request wrote are kept by key where pages are
        shared (a preempted request, or a later prompt that repeats this one, finds them)."""
        slot, self._active[i] = self._active[i], None
        if self._store is not None and slot is not None:
            self._store.release(i, slot.context()[: slot.position()])
            self._store.penalised.constrain(i, None)  # an idle slot costs no mask

    def _advance(self, ticked: Ticked, now: float) -> list[Event]:
        """The tick's tokens `(decode_steps, slots)`: a new token for each slot past its prompt
        at each step, until its request ends (the steps after it are dropped). Only a tick's
        first step feeds a prompt token (the last: the prefill wrote the others)."""
        events = []
        for step, row in enumerate(ticked.tokens.tolist()):
            for i, slot in enumerate(self._active):
                if slot is None:
                    continue
                if slot.fed < len(slot.request.prompt):
                    slot.fed += 1
                    if slot.fed < len(slot.request.prompt):
                        continue  # the logits of a prompt token that another one follows
                events.append(self._take(i, row[i], now, ticked.scores(step, i)))
        return events

    def _take(self, i: int, token: int, now: float, scores: Scores) -> Event:
        """Slot `i`'s request's new `token` (drawn by a tick, or by its prefill at admission:
        then its whole prompt is in the cache) with its `scores`; the slot freed if the token
        ends it."""
        slot = self._active[i]
        assert slot is not None
        r = slot.request
        slot.fed = max(slot.fed, len(r.prompt))
        if not slot.tokens:
            slot.first_token = now
        slot.tokens.append(token)
        logprob = top = None
        if r.logprobs is not None:
            slot.scores.append(scores)
            logprob = scores.logprob
            k = r.logprobs
            top = list(zip(scores.ids[:k].tolist(), scores.values[:k].tolist(), strict=True))
        stopped = token in r.stop_tokens
        if r.constraint is not None and not stopped:
            r.constraint.advance(token)
            stopped = r.constraint.finished  # complete: the end is all that may follow
            if not stopped and len(slot.tokens) < r.max_new_tokens:
                self._slots().penalised.constrain(i, r.constraint)
        done = None
        if stopped or len(slot.tokens) == r.max_new_tokens:
            self._free(i)
            done = completion(slot, "stop" if stopped else "length", now)
        prompt = slot.prompt_scores if len(slot.tokens) == 1 else None
        return Event(r.id, token, done, slot.cached, logprob, top, prompt)
