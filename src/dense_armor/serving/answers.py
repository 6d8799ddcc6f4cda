"""A request's answer as the engine generates it: each of its choices (`Choice`: one engine
request, its text through a `TextStream`, its scores through a `ScoreLog`) and the whole
answer (`Answer`): collected into one response, or streamed as server-sent events, the
choices' chunks in the order they arrive, each with its `index`."""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import jax

from .logprobs import ScoreLog, TokenText
from .metrics import Metrics
from .protocol import ApiError, Ask, choice, chunk, error_body, response
from .text import TextStream
from .tools import parse_calls
from .worker import Engine, Failed

__all__ = ["Answer", "Choice", "submit_choices"]


class Choice:
    """One choice: engine request `request_id`'s events (`queue`) as text and scores."""

    def __init__(
        self, index: int, request_id: str, prompt: list[int], queue: "asyncio.Queue[Any]",
        text: TextStream, scores: ScoreLog | None, echo: str,
    ) -> None:  # fmt: skip
        self.index, self.request_id, self.prompt, self.queue = index, request_id, prompt, queue
        self.text, self.scores, self.echo = text, scores, echo
        self.generated, self.cached = 0, 0
        self.first: float | None = None  # when its first token came

    async def pieces(self, engine: Engine, metrics: Metrics) -> AsyncIterator[tuple[Any, ...]]:
        """`(new text, finish reason or None, the new token's logprobs object or None)` as
        tokens arrive; ends after the reason (a stop string cancels the engine's request)."""
        while True:
            item = await self.queue.get()
            if isinstance(item, Failed):
                raise RuntimeError(item.message)
            self.generated, self.cached = self.generated + 1, item.cached_tokens
            metrics.token()
            if self.first is None:
                self.first = time.perf_counter()
            scored = None if self.scores is None else self.scores.add(item)
            piece = self.text.push(item.token)
            if self.text.stopped:  # a stop string: the choice ends here
                engine.cancel(self.request_id)
                yield piece, "stop", scored
                return
            if item.completion is not None:
                yield piece + self.text.finish(), item.completion.reason, scored
                return
            yield piece, None, scored


class Answer:
    """A request's choices, whole (`whole`) or as server-sent events (`events`)."""

    def __init__(
        self, ask: Ask, choices: list[Choice], engine: Engine, metrics: Metrics,
        tool_format: str = "hermes",
    ) -> None:  # fmt: skip
        self.ask, self.choices, self.engine, self.metrics = ask, choices, engine, metrics
        tools = ask.tools
        # a chat whose tools it may call: its text read for calls when it ends (`tools`)
        self.tools = None if tools is None or tools.choice == "none" else (tools, tool_format)
        self.started = time.perf_counter()
        self._first_seen = False

    def cancel(self) -> None:
        for c in self.choices:
            self.engine.cancel(c.request_id)

    def _counts(self) -> tuple[int, int, int]:
        """The usage: each prompt's tokens once, every choice's new tokens, the cached."""
        prompts = {c.index // self.ask.n: len(c.prompt) for c in self.choices}
        cached = {c.index // self.ask.n: c.cached for c in self.choices}
        generated = sum(c.generated for c in self.choices)
        return sum(prompts.values()), generated, sum(cached.values())

    def _seen(self, c: Choice) -> None:
        if not self._first_seen and c.first is not None:
            self._first_seen = True
            self.metrics.first_token(c.first - self.started)

    async def _whole_choice(self, c: Choice) -> dict[str, Any]:
        parts, reason = [c.echo], "length"
        async for piece, end, _ in c.pieces(self.engine, self.metrics):
            self._seen(c)
            parts.append(piece)
            reason = end or reason
        logprobs = None if c.scores is None else c.scores.whole()
        text, calls = self._calls("".join(parts))
        return choice(self.ask, c.index, text, reason, logprobs, calls)

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A chat's text as its content and tool calls (none without tools)."""
        if self.tools is None:
            return text, []
        tools, form = self.tools
        return parse_calls(text, form, tools)

    async def whole(self, request: Any) -> dict[str, Any] | ApiError | None:
        """The whole answer; None if the client disconnected first."""
        work = asyncio.gather(*(self._whole_choice(c) for c in self.choices))
        done = await _unless_disconnected(request, work)
        if done is None:
            self.cancel()
            return None
        if isinstance(done, BaseException):
            self.cancel()
            return ApiError(f"generation failed: {done}", None, 500, "server_error")
        self.metrics.finished(time.perf_counter() - self.started)
        return response(self.ask, list(done), self._counts())

    async def _chunks(self, c: Choice, out: "asyncio.Queue[Any]") -> None:
        """Choice `c`'s chunks onto `out`, then None (or the exception that ended it)."""
        ask = self.ask
        try:
            if ask.chat:
                await out.put(chunk(ask, None, role=True, index=c.index))
            if c.echo:
                await out.put(chunk(ask, c.echo, index=c.index))
            held = []  # with tools, the text held to its end, where its calls are read
            async for piece, reason, scored in c.pieces(self.engine, self.metrics):
                self._seen(c)
                if self.tools is not None:
                    held.append(piece)
                elif piece or scored is not None:
                    await out.put(chunk(ask, piece, logprobs=scored, index=c.index))
                if reason is not None and self.tools is None:
                    await out.put(chunk(ask, None, reason, index=c.index))
                elif reason is not None:
                    text, calls = self._calls("".join(held))
                    await out.put(chunk(ask, text, reason, index=c.index, calls=calls))
            await out.put(None)
        except Exception as error:  # a failed generation: the stream's error event
            await out.put(error)

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: each choice's role first (a chat), text chunks, its end, in the
        order they come; the usage if asked, `[DONE]`; an error event then `[DONE]` if
        generation fails."""
        out: asyncio.Queue[Any] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._chunks(c, out)) for c in self.choices]
        try:
            left = len(tasks)
            while left:
                item = await out.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    failed = ApiError(f"generation failed: {item}", None, 500, "server_error")
                    yield _sse(error_body(failed))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield _sse(item)
            self.metrics.finished(time.perf_counter() - self.started)
            if self.ask.include_usage:
                yield _sse(chunk(self.ask, None, counts=self._counts()))
            yield "data: [DONE]\n\n"
        finally:  # a client that left mid-stream (the generator closed): free its slots
            for task in tasks:
                task.cancel()
            self.cancel()


def submit_choices(
    ask: Ask, prompts: list[list[int]], rules: list[Any], stops: list[int], engine: Engine,
    tokenizer: Any, texts: TokenText, constrain: Callable[[], Any] | None = None,
) -> list[Choice]:  # fmt: skip
    """Each prompt's `n` choices queued as requests of their own (a choice `j > 0` of a request
    with a seed draws with `fold_in(key, j)`), each with its own grammar from `constrain` if
    given; on a refusal the ones queued are cancelled."""
    choices: list[Choice] = []
    single = len(prompts) * ask.n == 1
    try:
        for p, (prompt, (sampling, key, max_new)) in enumerate(zip(prompts, rules, strict=True)):
            echo = _echo(ask, p, prompt, tokenizer)
            for j in range(ask.n):
                index = p * ask.n + j
                request_id = ask.id if single else f"{ask.id}-{index}"
                own = key if key is None or j == 0 else jax.random.fold_in(key, j)
                queue = engine.submit(
                    request_id, prompt, max_new, sampling, own, stops, logprobs=ask.logprobs,
                    prompt_logprobs=ask.logprobs is not None and ask.echo,
                    **({} if constrain is None else {"constraint": constrain()}),
                )  # fmt: skip
                scores = None
                if ask.logprobs is not None:
                    scores = ScoreLog(texts, ask.chat, ask.logprobs, ask.echo, prompt)
                text = TextStream(tokenizer, ask.stop)
                choices.append(Choice(index, request_id, prompt, queue, text, scores, echo))
    except BaseException:
        for c in choices:
            engine.cancel(c.request_id)
        raise
    return choices


def _echo(ask: Ask, p: int, prompt: list[int], tokenizer: Any) -> str:
    """A completion's echoed prompt `p` (`echo`): its text as given, or a token prompt's
    decoding."""
    if not ask.echo:
        return ""
    given = (ask.prompts or [])[p]
    return given if isinstance(given, str) else tokenizer.decode(prompt)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _unless_disconnected(request: Any, work: Any) -> Any:
    """`work`'s result, or None if the client disconnects first (an exception is returned)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        return None
    watch.cancel()
    error = task.exception()
    return error if error is not None else task.result()
