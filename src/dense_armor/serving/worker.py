"""The thread that steps a `Server` for the HTTP application (`dense_armor.serving.http`): it
sleeps while the server is idle, admits a burst of requests that arrive together in one round,
and hands each request its events on the event loop that asked for it."""

import asyncio
import threading
import time
from typing import Any

from .engine import Sampling, Server

# an idle server's wait for the rest of a burst of requests (`Engine._gather`), in seconds
BURST_GAP, BURST_WINDOW = 0.005, 0.025


class Failed:
    """The engine's step raised: every request in flight ends with this message."""

    def __init__(self, message: str) -> None:
        self.message = message


class Engine:
    """The thread that steps `server` and hands each request its events (on the event loop)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="dense-armor-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        max_new: int,
        sampling: Sampling,
        key: Any,
        stops: list[int],
        **scores: Any,
    ) -> "asyncio.Queue[Any]":
        """Queue a request (`scores`: its `logprobs` and `prompt_logprobs`, as
        `Server.submit`'s); the queue its events arrive on. `QueueFull` past the bound."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.server.submit(
                prompt, max_new, request_id, sampling=sampling, key=key, stop_tokens=stops,
                **scores,
            )  # fmt: skip
        except BaseException:
            with self._lock:
                self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return queue

    def cancel(self, request_id: str) -> None:
        """Drop a request (its slot free before the next tick); nothing if it finished."""
        with self._lock:
            known = self._queues.pop(request_id, None) is not None
        if known:
            self.server.cancel(request_id)
            self._wake.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._queues)

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._closing:
            if self.server.idle:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                if not self.server.idle:
                    self._gather()
                continue
            try:
                events: list[Any] = self.server.step()
            except Exception as error:  # the model failed: every request in flight ends
                events = self._fail(f"{type(error).__name__}: {error}")
            for event in events:
                self._deliver(event)

    def _gather(self) -> None:
        """Requests that arrive together are admitted together: after the first arrival at an
        idle server, wait while more keep coming (each within `BURST_GAP` of the one before), at
        most `BURST_WINDOW`. Stepping at once admitted one or two of eight clients' requests
        sent together and prefilled the rest a round later, at four times their first token's
        time (the prefill of one round is the wait of the next)."""
        deadline = time.monotonic() + BURST_WINDOW
        while (left := deadline - time.monotonic()) > 0 and self._wake.wait(min(BURST_GAP, left)):
            self._wake.clear()

    def _deliver(self, event: Any) -> None:
        """Hand an `Event` (or a `(request id, Failed)` pair) to its request's queue; the
        request's entry goes with its last event."""
        if isinstance(event, tuple):
            request_id, item, last = event[0], event[1], True
        else:
            request_id, item, last = event.id, event, event.completion is not None
        with self._lock:
            entry = self._queues.pop(request_id, None) if last else self._queues.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail(self, message: str) -> list[Any]:
        with self._lock:
            ids = list(self._queues)
        for request_id in ids:
            self.server.cancel(request_id)
        return [(request_id, Failed(message)) for request_id in ids]
