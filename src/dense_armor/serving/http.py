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

from .answers import Answer, Choice, submit_choices
from .chat import ChatError, ChatTemplate
from .engine import QueueFull, Sampling, Server
from .grammar import GrammarError, Grammars
from .logprobs import TokenText
from .metrics import Metrics
from .protocol import (
    ApiError,
    Ask,
    Defaults,
    error_body,
    parse_chat,
    parse_completion,
)  # fmt: skip
from .tools import FORMATS, call_grammar
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
    tool_format: str = "hermes",
) -> Any:
    """The ASGI application serving `server`'s model as `name` (see the module); `tokenizer`
    decodes and encodes text, `chat_template` renders chats (none: the chat endpoint answers
    400), `eos` the token ids that end every request (with each request's `stop_token_ids`),
    `defaults` what a request that leaves out `temperature`, `top_k`, `top_p`, `min_p` or
    `max_tokens` gets (OpenAI's defaults unless given), `tool_format` how the model writes tool
    calls (`tools.FORMATS`)."""
    if tool_format not in FORMATS:
        raise ValueError(
            f"create_app: `tool_format` is one of {FORMATS}; received {tool_format!r}."
        )
    from starlette.applications import Starlette
    from starlette.routing import Route

    routes = _Routes(server, tokenizer, name, chat_template, eos, defaults, tool_format)
    table = [
        Route("/tokenize", routes.tokenize, methods=["POST"]),
        Route("/detokenize", routes.detokenize, methods=["POST"]),
        Route("/tokenizer_info", routes.tokenizer_info, methods=["GET"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.scrape, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        routes.engine.close()

    app = Starlette(routes=table, lifespan=lifespan, exception_handlers=_handlers(routes.failure))
    app.state.engine, app.state.metrics = routes.engine, routes.metrics
    return app


class _Routes:
    """The application's routes over one engine (`create_app`'s arguments)."""

    def __init__(
        self, server: Server, tokenizer: Any, name: str, template: ChatTemplate | None,
        eos: list[int] | None, defaults: Defaults | None, tool_format: str,
    ) -> None:  # fmt: skip
        self.server, self.tokenizer, self.name, self.template = server, tokenizer, name, template
        self.engine = Engine(server)
        self.metrics = Metrics(server, self.engine)
        self.vocab, self.ends = server.model.vocab, list(eos or [])
        self.defaults = Defaults() if defaults is None else defaults
        self.texts = TokenText(tokenizer)
        self.grammars = _grammars(server, tokenizer, self.ends)
        self.tool_format = tool_format

    def failure(self, error: ApiError) -> Any:
        from starlette.responses import JSONResponse

        self.metrics.refused(error.status)
        return JSONResponse(error_body(error), status_code=error.status)

    def _choices(self, raw: bytes, chat: bool) -> tuple[Ask, list[Choice]]:
        """A request checked, and its choices queued (`ApiError`, `QueueFull`)."""
        server = self.server
        ask = _parse(raw, chat, self.vocab, self.name, server.max_logprobs)
        prompts = _prompt_ids(ask, self.tokenizer, self.template)
        rules = [_rules(ask, len(p), _limit(server), self.defaults) for p in prompts]
        stops = sorted(set(self.ends + ask.stop_token_ids))
        texts, tokenizer = self.texts, self.tokenizer
        constrain = _constraints(ask, self.grammars, self.tool_format)
        return ask, submit_choices(
            ask, prompts, rules, stops, self.engine, tokenizer, texts, constrain
        )

    async def complete(self, request: Any, chat: bool) -> Any:
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

        try:
            ask, choices = self._choices(await _body(request), chat)
        except ApiError as error:
            return self.failure(error)
        except QueueFull as error:
            return self.failure(ApiError(str(error), None, 503, "server_overloaded", "queue_full"))
        answer = Answer(ask, choices, self.engine, self.metrics, self.tool_format)
        if ask.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream")
        whole = await answer.whole(request)
        if whole is None:  # the client left
            return PlainTextResponse("", status_code=499)
        if isinstance(whole, ApiError):
            return self.failure(whole)
        return JSONResponse(whole)

    async def completions(self, request: Any) -> Any:
        return await self.complete(request, chat=False)

    async def chat_completions(self, request: Any) -> Any:
        return await self.complete(request, chat=True)

    async def models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        model = {"id": self.name, "object": "model", "created": 0, "owned_by": "dense_armor"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        server = self.server
        return JSONResponse({"status": "ok", "queued": server.pending, "busy": server.busy})

    async def scrape(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        return PlainTextResponse(self.metrics.text(), media_type=self.metrics.content_type)

    async def tokenize(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = _tokens_body(await _body(request), self.name)
            ids = _tokenized(body, self.tokenizer, self.template)
        except ApiError as error:
            return self.failure(error)
        count, most = len(ids), self.server.capacity
        return JSONResponse({"count": count, "max_model_len": most, "tokens": ids})

    async def tokenizer_info(self, request: Any) -> Any:
        """vLLM's `/tokenizer_info`: the end-of-sequence token's text (the first of the ends), the
        context; what a client that tokenizes through the server (lm-evaluation-harness's
        remote tokenizer) reads besides `/tokenize` and `/detokenize`."""
        from starlette.responses import JSONResponse

        eos = self.tokenizer.id_to_token(self.ends[0]) if self.ends else None
        return JSONResponse({
            "eos_token": eos, "bos_token": None, "pad_token": None,
            "model_max_length": self.server.capacity, "tokenizer_class": "tokenizers.Tokenizer",
        })  # fmt: skip

    async def detokenize(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        vocab = self.vocab
        try:
            ids = _tokens_body(await _body(request), self.name).get("tokens")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
            ):
                raise ApiError(f"`tokens` must be a list of token ids in [0, {vocab}).", "tokens")
        except ApiError as error:
            return self.failure(error)
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})


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


def _grammars(server: Server, tokenizer: Any, ends: list[int]) -> Grammars | None:
    """The grammars of `response_format` where the server takes constraints (`structured`) and
    the grammar engine is installed; None elsewhere (such a request is refused by name)."""
    if not server.structured:
        return None
    try:
        return Grammars(tokenizer, server.model.vocab, ends)
    except ImportError:
        return None


def _constraints(ask: Ask, grammars: Grammars | None, tool_format: str) -> Callable[[], Any] | None:
    """A maker of `ask`'s grammar for each of its choices, its `response_format`'s or the tool
    calls its `tool_choice` demands (in `tool_format`; compiled once, now, so that a bad one is
    refused before anything is queued); None for free text."""
    form = ask.response_format
    lark = None if ask.tools is None else call_grammar(ask.tools, tool_format)
    if lark is not None:
        if form is not None:
            raise ApiError(
                "`tool_choice` demands tool calls: `response_format` cannot be asked with it.",
                "response_format",
            )
        form = ("lark", lark)
    if form is None:
        return None
    if grammars is None:
        raise ApiError(
            "`response_format` json_object and json_schema need a server started with structured "
            "output (`Server(structured=True)` and the grammar engine: pip install "
            "'dense_armor[structured]').", "response_format",
        )  # fmt: skip

    def make() -> Any:
        assert grammars is not None and form is not None
        if form[0] == "json_object":
            return grammars.json_object()
        if form[0] == "lark":
            return grammars.lark(form[1], "tool_choice")
        return grammars.json_schema(*form[1:])

    try:
        make()
    except GrammarError as error:
        raise ApiError(str(error), error.field) from None
    return make


def _prompt_ids(ask: Ask, tokenizer: Any, template: ChatTemplate | None) -> list[list[int]]:
    """The token ids of each of the request's prompts (a chat's rendered messages)."""
    if ask.chat:
        if template is None:
            raise ApiError("this model has no chat template: use /v1/completions.", "messages")
        try:
            tools = None if ask.tools is None else ask.tools.specs
            text = template.render(ask.messages or [], add_generation_prompt=True, tools=tools)
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
    sampling = Sampling(
        float(ask.temperature or 0.0), ask.top_k, ask.top_p, ask.min_p, ask.penalties
    )
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
