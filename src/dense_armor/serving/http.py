"""An OpenAI-compatible HTTP server on the serving engine (the `serve` extra: Starlette, uvicorn,
jinja2, prometheus-client).

`create_app(server, tokenizer, name)` is an ASGI application with `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /v1/models`, `GET /health` and `GET /metrics` (Prometheus
text). One thread steps the `Server` while it has work (`worker.Engine`); each request waits on
its own queue of the engine's events, decoded into text by a `TextStream` (whole characters only,
stop strings cut across token boundaries). A client that disconnects, streaming or not, has its
request cancelled: its slot is free before the next tick. `serve_http(...)` runs the application
with uvicorn.
"""

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import jax

from .answers import Answer, Choice
from .chat import ChatError, ChatTemplate
from .engine import QueueFull, Sampling, Server
from .logprobs import ScoreLog, TokenText
from .metrics import Metrics
from .protocol import (
    ApiError,
    Ask,
    Defaults,
    error_body,
    parse_chat,
    parse_completion,
)  # fmt: skip
from .text import TextStream
from .worker import Engine

__all__ = ["create_app", "serve_http"]

# The fields a request may leave to the server's `Defaults`
DEFAULTED = ("temperature", "top_k", "top_p", "min_p", "max_tokens")


def create_app(
    server: Server,
    tokenizer: Any,
    name: str,
    chat_template: ChatTemplate | None = None,
    eos: list[int] | None = None,
    defaults: Defaults | None = None,
) -> Any:
    """The ASGI application serving `server`'s model as `name` (see the module); `tokenizer`
    decodes and encodes text, `chat_template` renders chats (none: the chat endpoint answers
    400), `eos` the token ids that end every request (with each request's `stop_token_ids`),
    `defaults` what a request that leaves out `temperature`, `top_k`, `top_p`, `min_p` or
    `max_tokens` gets (OpenAI's defaults unless given)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    engine = Engine(server)
    metrics = Metrics(server, engine)
    vocab = server.model.vocab
    ends = list(eos or [])
    defaults = Defaults() if defaults is None else defaults
    texts = TokenText(tokenizer)

    def failure(error: ApiError) -> JSONResponse:
        metrics.refused(error.status)
        return JSONResponse(error_body(error), status_code=error.status)

    async def complete(request: Request, chat: bool) -> Any:
        try:
            ask = _parse(await _body(request), chat, vocab, name, server.max_logprobs)
            prompts = _prompt_ids(ask, tokenizer, chat_template)
            rules = [_rules(ask, len(p), _limit(server), defaults) for p in prompts]
            stops = sorted(set(ends + ask.stop_token_ids))
            choices = _submitted(ask, prompts, rules, stops, engine, tokenizer, texts)
        except ApiError as error:
            return failure(error)
        except QueueFull as error:
            return failure(ApiError(str(error), None, 503, "server_overloaded", "queue_full"))
        answer = Answer(ask, choices, engine, metrics)
        if ask.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream")
        whole = await answer.whole(request)
        if whole is None:  # the client left
            return PlainTextResponse("", status_code=499)
        if isinstance(whole, ApiError):
            return failure(whole)
        return JSONResponse(whole)

    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    async def models(request: Request) -> Any:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "dense_armor"}],
            }
        )

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok", "queued": server.pending, "busy": server.busy})

    async def scrape(request: Request) -> Any:
        return PlainTextResponse(metrics.text(), media_type=metrics.content_type)

    async def tokenize(request: Request) -> Any:
        try:
            body = _tokens_body(await _body(request), name)
            ids = _tokenized(body, tokenizer, chat_template)
        except ApiError as error:
            return failure(error)
        return JSONResponse({"count": len(ids), "max_model_len": server.capacity, "tokens": ids})

    async def detokenize(request: Request) -> Any:
        try:
            body = _tokens_body(await _body(request), name)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
            ):
                raise ApiError(f"`tokens` must be a list of token ids in [0, {vocab}).", "tokens")
        except ApiError as error:
            return failure(error)
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    routes = [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", scrape, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        engine.close()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=_handlers(failure))
    app.state.engine, app.state.metrics = engine, metrics
    return app


# OpenAI's error type and code of the answers no route gives itself
STATUS_KINDS = {
    404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", "unprocessable_entity"), 500: ("server_error", "internal_error"),
}  # fmt: skip
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
         "/health", "/metrics")  # fmt: skip
MAX_BODY = 8 * 2**20  # the bytes of a request's body (413 past them)


def _handlers(failure: Callable[[ApiError], Any]) -> dict[Any, Any]:
    """Starlette's own answers (no such route, a method the route does not take, a crash) as
    OpenAI's error object, each counted as every refusal is."""
    from starlette.exceptions import HTTPException

    async def refused(request: Any, error: Any) -> Any:
        status = int(error.status_code)
        kind, code = STATUS_KINDS.get(status, ("invalid_request_error", None))
        where = f"{request.method} {request.url.path}"
        message = {
            404: f"{where}: no such route; this server answers {', '.join(PATHS)}.",
            405: f"{where}: the route does not take {request.method}.",
        }.get(status, f"{where}: {error.detail}")
        answer = failure(ApiError(message, None, status, kind, code))
        for header, value in (error.headers or {}).items():
            answer.headers[header] = value
        return answer

    async def crashed(request: Any, error: Exception) -> Any:
        kind, code = STATUS_KINDS[500]
        message = f"the server failed on this request ({type(error).__name__}: {error})."
        return failure(ApiError(message, None, 500, kind, code))

    return {HTTPException: refused, Exception: crashed}


async def _body(request: Any) -> bytes:
    """The request's body, refused (413) past `MAX_BODY` bytes before it is all read."""
    too_large = ApiError(
        f"the request body passes {MAX_BODY} bytes.", None, 413, *STATUS_KINDS[413]
    )
    stated = request.headers.get("content-length")
    if stated is not None and stated.isdigit() and int(stated) > MAX_BODY:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def _parse(raw: bytes, chat: bool, vocab: int, name: str, most: int | None) -> Ask:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not JSON: {error}.") from None
    ask = (parse_chat if chat else parse_completion)(body, vocab, most)
    if ask.model != name:
        raise ApiError(
            f"the model `{ask.model}` does not exist; this server serves `{name}`.",
            "model",
            404,
            "not_found_error",
            "model_not_found",
        )
    return ask


def _prompt_ids(ask: Ask, tokenizer: Any, template: ChatTemplate | None) -> list[list[int]]:
    """The token ids of each of the request's prompts (a chat's rendered messages)."""
    if ask.chat:
        if template is None:
            raise ApiError("this model has no chat template: use /v1/completions.", "messages")
        try:
            text = template.render(ask.messages or [], add_generation_prompt=True)
        except ChatError as error:
            raise ApiError(str(error), "messages") from None
        return [list(tokenizer.encode(text, add_special_tokens=False).ids)]
    return [
        list(p) if isinstance(p, list) else list(tokenizer.encode(p).ids) for p in ask.prompts or []
    ]


def _tokens_body(raw: bytes, name: str) -> dict[str, Any]:
    """A `/tokenize` or `/detokenize` body: a JSON object; its `model`, if given, this one."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not JSON: {error}.") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object.")
    if body.get("model") not in (None, name):
        raise ApiError(
            f"the model `{body['model']}` does not exist; this server serves `{name}`.",
            "model", 404, "not_found_error", "model_not_found",
        )  # fmt: skip
    return body


def _tokenized(body: dict[str, Any], tokenizer: Any, template: ChatTemplate | None) -> list[int]:
    """`/tokenize`: a `prompt`'s token ids (`add_special_tokens`, default true), or a chat's
    `messages` rendered by the template (`add_generation_prompt`, default true)."""
    if "messages" in body:
        ask = parse_chat({"model": "m", "messages": body["messages"]}, 1)
        if template is None:
            raise ApiError("this model has no chat template.", "messages")
        generation = body.get("add_generation_prompt", True)
        if not isinstance(generation, bool):
            raise ApiError(
                "`add_generation_prompt` must be true or false.", "add_generation_prompt"
            )
        try:
            text = template.render(ask.messages or [], add_generation_prompt=generation)
        except ChatError as error:
            raise ApiError(str(error), "messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(prompt, str):
        raise ApiError("`prompt` must be a string (or give `messages`).", "prompt")
    if not isinstance(special, bool):
        raise ApiError("`add_special_tokens` must be true or false.", "add_special_tokens")
    return list(tokenizer.encode(prompt, add_special_tokens=special).ids)


def _submitted(
    ask: Ask, prompts: list[list[int]], rules: list[Any], stops: list[int], engine: Engine,
    tokenizer: Any, texts: TokenText,
) -> list[Choice]:  # fmt: skip
    """Each prompt's `n` choices queued as requests of their own (a choice `j > 0` of a request
    with a seed draws with `fold_in(key, j)`); on a refusal the ones queued are cancelled."""
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


def _limit(server: Server) -> tuple[int, str]:
    """The most positions a request may take, and what sets it: the context (each slot's
    capacity) or, when it is shorter, a paged server's pool."""
    longest, pool = server.longest_request, server.pool
    if longest == server.capacity or pool is None:
        return longest, f"the context ({longest} tokens)"
    pages, size = pool
    return longest, (
        f"the page pool ({pages - 1} pages of {size} positions: {longest} tokens for one "
        f"request; the context is {server.capacity})"
    )


def _rules(
    ask: Ask, prompt: int, limit: tuple[int, str], defaults: Defaults
) -> tuple[Sampling, Any, int]:
    """The request's sampling rules, key (its seed's, else None) and new tokens, each field the
    request leaves out from `defaults`; `limit`: the most positions a request may take, and
    what sets it."""
    unset = [field for field in DEFAULTED if getattr(ask, field) is None]
    ask = dataclasses.replace(ask, **{field: getattr(defaults, field) for field in unset})
    longest, what = limit
    room = longest - prompt
    if room < 1:
        raise ApiError(f"the prompt ({prompt} tokens) leaves no room in {what}.", "prompt")
    max_new = room if ask.max_tokens is None else ask.max_tokens
    if max_new > room and "max_tokens" in unset:
        max_new = room  # the server's default, cut to the room this prompt leaves
    if max_new > room:
        raise ApiError(
            f"the prompt ({prompt} tokens) and `max_tokens={max_new}` pass {what}.", "max_tokens"
        )
    sampling = Sampling(float(ask.temperature or 0.0), ask.top_k, ask.top_p, ask.min_p)
    key = None if ask.seed is None else jax.random.PRNGKey(ask.seed)
    return sampling, key, max_new


def serve_http(app: Any, host: str, port: int, announce: Callable[[str], None]) -> None:
    """Run `app` with uvicorn on `host:port` (0: a free port), calling `announce` with its URL
    once the socket listens."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    announce(f"http://{host}:{bound}")
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
