"""OpenAI's completions and chat completions protocol: requests checked into `Ask`s, and the
response, chunk and error objects.

Every field a request may hold is checked by type and range, and a bad one is an `ApiError`
naming it (`param`), which the HTTP application answers with OpenAI's error object and a 400.
What is not built is refused the same way, never ignored: `n` above `MAX_N`, `best_of` above 1,
`suffix`, the deprecated `functions`, and tools on the completions endpoint (the chat endpoint
serves them). `response_format` (`json_object`, `json_schema`) is read where the server has a
grammar engine (`grammar.Grammars`), and refused by name where it has not. A
field that changes nothing an answer holds (`INERT`: `user`, `metadata`, `store`, ...) is
accepted and ignored, as OpenAI's server does; any other field a request sets is refused by
name (a peer's extension such as `repetition_penalty` would otherwise be silently without
effect).
"""

import dataclasses
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..nn.penalties import Penalties, PenaltyError, check_penalties
from .errors import ApiError, error_body
from .tools import check_tools

__all__ = [
    "ApiError", "Ask", "Defaults", "choice", "chunk", "error_body", "parse_chat",
    "parse_completion", "response",
]  # fmt: skip

MAX_STOPS = 16  # stop strings per request (OpenAI allows 4; vLLM more)
MAX_N, MAX_CHOICES = 16, 64  # choices per prompt (`n`), and in all (prompts times `n`)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets: OpenAI's defaults (`temperature` 1, no
    `top_p`, `top_k` or `min_p`; `max_tokens` the room left in the context), or the server's own
    (`dense-armor serve --temperature ...`)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_tokens: int | None = None


@dataclasses.dataclass
class Ask:
    """A checked request: its `prompts` (each text, or token ids), or `messages` for a chat;
    `n` choices of each."""

    chat: bool
    model: str
    prompts: list[str | list[int]] | None
    messages: list[dict[str, Any]] | None
    max_tokens: int | None  # None: unset in the request (see `Defaults`), as the three below
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # alternatives with each token's score; None: no scores
    echo: bool = False  # a completion's text and scores begin with its prompt's
    penalties: Penalties = dataclasses.field(default_factory=Penalties)
    response_format: tuple[Any, ...] | None = None  # `_response_format`'s: None for text
    tools: Any = None  # a chat's `tools.Tools`, or None
    id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(12))
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(body: Mapping[str, Any], name: str, low: int, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < low:
        raise ApiError(f"`{name}` must be an integer >= {low}; received {value!r}.", name)
    return value


def _number(
    body: Mapping[str, Any],
    name: str,
    low: float,
    high: float,
    default: Any,
    open_low: bool = False,
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    bad = not _is_number(value) or value > high or (value <= low if open_low else value < low)
    if bad:
        span = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ApiError(f"`{name}` must be a number in {span}; received {value!r}.", name)
    return float(value)


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = _integer(body, "seed", 0)
    if seed is not None and seed >= 2**63:
        raise ApiError(f"`seed` must be below 2**63; received {seed}.", "seed")
    return seed


# The fields a request's answer reads (both endpoints; each checked by its rule below) ...
READ = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "stream", "stream_options",
    "logprobs", "top_logprobs", "echo", "n", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
})  # fmt: skip
# ... those whose features are refused unless at their default (`_refused`) ...
NOT_BUILT = frozenset({
    "best_of", "suffix", "functions", "function_call", "modalities",
})  # fmt: skip
# ... and those that change nothing an answer holds (bookkeeping, caching hints, a choice that
# only matters with tools), accepted and ignored as OpenAI's server does.
INERT = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
})  # fmt: skip


def _unknown(body: Mapping[str, Any]) -> None:
    """Any other field a request sets (not null) is refused by name."""
    for name, value in body.items():
        if value is not None and name not in READ | NOT_BUILT | INERT:
            raise ApiError(f"`{name}` is not a field this server implements.", name)


def _refused(body: Mapping[str, Any]) -> None:
    """The fields whose features are not built, refused unless at their neutral value."""
    neutral: dict[str, tuple[Any, ...]] = {
        "best_of": (None, 1),
        "suffix": (None, ""),
        "functions": (None, []),
        "function_call": (None, "none"),
        "modalities": (None, ["text"]),
    }
    for name, allowed in neutral.items():
        value = body.get(name)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ApiError(
                f"`{name}={value!r}` is not supported by this server (only the default).", name
            )


def _response_format(body: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """`response_format`: None for text, `("json_object",)`, or `("json_schema", schema,
    strict)` (its `json_schema.schema`, an object; `strict` true unless false)."""
    form = body.get("response_format")
    kind = form.get("type") if isinstance(form, Mapping) else None
    if form is None or kind == "text":
        return None
    if kind == "json_object":
        return ("json_object",)
    if kind != "json_schema":
        raise ApiError(
            '`response_format` must be {"type": "text"}, {"type": "json_object"} or {"type": '
            '"json_schema", "json_schema": {"name": ..., "schema": {...}}}.', "response_format",
        )  # fmt: skip
    spec = form.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, Mapping) else None
    strict = spec.get("strict") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping) or not isinstance(strict, bool | None):
        raise ApiError(
            "`response_format.json_schema` must be an object with a `schema` object (and a "
            "boolean `strict`).", "response_format",
        )  # fmt: skip
    return ("json_schema", dict(schema), strict is not False)


def _stops(body: Mapping[str, Any], vocab: int) -> tuple[list[str], list[int]]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("`stop` must be a non-empty string or a list of them.", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(f"`stop` holds at most {MAX_STOPS} strings; received {len(stops)}.", "stop")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(_is_int(i) and 0 <= i < vocab for i in ids):
        raise ApiError(
            f"`stop_token_ids` must be a list of token ids in [0, {vocab}).", "stop_token_ids"
        )
    return stops, ids


def _common(body: Any, chat: bool, vocab: int) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiError("the request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("`model` must be a non-empty string (GET /v1/models lists them).", "model")
    _unknown(body)
    _refused(body)
    top_k = _integer(body, "top_k", -1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"`stream` must be true or false; received {stream!r}.", "stream")
    options = body.get("stream_options") or {}
    usage = options.get("include_usage", False) if isinstance(options, Mapping) else None
    if not isinstance(usage, bool):
        raise ApiError(
            "`stream_options` must be an object with a boolean `include_usage`.", "stream_options"
        )
    stop, stop_ids = _stops(body, vocab)
    n = _integer(body, "n", 1, 1)
    if n > MAX_N:
        raise ApiError(f"`n` must be at most {MAX_N}; received {n}.", "n")
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    return dict(
        chat=chat,
        model=model,
        max_tokens=_integer(body, name, 1),
        temperature=_number(body, "temperature", 0.0, 2.0, None),
        top_p=_number(body, "top_p", 0.0, 1.0, None, open_low=True),
        top_k=None if top_k in (None, -1, 0) else top_k,
        min_p=_number(body, "min_p", 0.0, 1.0, None),
        seed=_seed(body),
        stop=stop,
        stop_token_ids=stop_ids,
        stream=stream,
        include_usage=usage,
        n=n,
        penalties=_penalties(body, vocab),
        response_format=_response_format(body),
    )


def _penalties(body: Mapping[str, Any], vocab: int) -> Penalties:
    """`presence_penalty` and `frequency_penalty` (OpenAI's, in [-2, 2]), `repetition_penalty`
    (vLLM's, > 0) and `logit_bias` (an object of token ids, as strings, to numbers in [-100,
    100]), checked by `check_penalties`; a refusal names its field."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, Mapping):
        raise ApiError("`logit_bias` must be an object of token ids to numbers.", "logit_bias")
    for name in bias:
        if not (isinstance(name, str) and name.isascii() and name.isdigit()):
            raise ApiError(f"`logit_bias`: {name!r} is not a token id.", "logit_bias")
    given = {name: body.get(name) for name in ("presence_penalty", "frequency_penalty")}
    repetition = body.get("repetition_penalty")
    penalties = Penalties(
        0.0 if given["presence_penalty"] is None else given["presence_penalty"],
        0.0 if given["frequency_penalty"] is None else given["frequency_penalty"],
        1.0 if repetition is None else repetition,
        tuple((int(name), value) for name, value in bias.items()),
    )
    try:
        return check_penalties(penalties, vocab)
    except PenaltyError as error:
        raise ApiError(str(error), error.field) from None


def _scores(body: Mapping[str, Any], chat: bool, most: int | None) -> dict[str, Any]:
    """The scores asked for: a completion's `logprobs` (alternatives, 0 to `most`) and `echo`;
    a chat's `logprobs` (true or false) and `top_logprobs` (0 to `most`). `most` None: the
    server computes none."""
    if chat:
        wanted = body.get("logprobs") or False
        if not isinstance(wanted, bool):
            raise ApiError(f"`logprobs` must be true or false; received {wanted!r}.", "logprobs")
        top = _integer(body, "top_logprobs", 0)
        if top is not None and not wanted:
            raise ApiError("`top_logprobs` needs `logprobs: true`.", "top_logprobs")
        count, name, echo = (top or 0) if wanted else None, "top_logprobs", False
    else:
        count, name = _integer(body, "logprobs", 0), "logprobs"
        echo = body.get("echo") or False
        if not isinstance(echo, bool):
            raise ApiError(f"`echo` must be true or false; received {echo!r}.", "echo")
    if count is not None and (most is None or count > most):
        limit = "computes none" if most is None else f"gives at most {most}"
        raise ApiError(f"`{name}={count}`: this server {limit} (serve --max-logprobs).", name)
    return {"logprobs": count, "echo": echo}


def parse_completion(body: Any, vocab: int, most: int | None = None) -> Ask:
    """A `POST /v1/completions` body as an `Ask` (`ApiError` for a bad field); `most`: the
    alternatives a request may ask with its scores (None: no scores)."""
    fields = _common(body, False, vocab)
    fields.update(_scores(body, False, most))
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) not in (None, []):
            raise ApiError(f"`{name}` is a chat field (/v1/chat/completions).", name)
    prompts = _prompts(body.get("prompt"), vocab)
    if len(prompts) * fields["n"] > MAX_CHOICES:
        raise ApiError(
            f"{len(prompts)} prompts of `n={fields['n']}` choices each pass the {MAX_CHOICES} "
            "choices a request may ask.",
            "n",
        )
    return Ask(prompts=prompts, messages=None, **fields)


def _prompts(prompt: Any, vocab: int) -> list[str | list[int]]:
    """A completion's `prompt`: a string, a list of token ids, or a list of either."""
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    prompts = prompt if several else [prompt]
    for one in prompts:
        if isinstance(one, list):
            if not one or not all(_is_int(i) and 0 <= i < vocab for i in one):
                raise ApiError(
                    f"`prompt` must be a string, a non-empty list of token ids in [0, {vocab}), "
                    "or a list of either.",
                    "prompt",
                )
        elif not isinstance(one, str) or not one:
            raise ApiError(
                "`prompt` must be a non-empty string, a list of token ids, or a list of either.",
                "prompt",
            )
    return prompts


def parse_chat(body: Any, vocab: int, most: int | None = None) -> Ask:
    """A `POST /v1/chat/completions` body as an `Ask` (`ApiError` for a bad field)."""
    fields = _common(body, True, vocab)
    fields.update(_scores(body, True, most))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("`messages` must be a non-empty list of messages.", "messages")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    return Ask(prompts=None, messages=chat, tools=check_tools(body), **fields)


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ApiError(f"`{where}` must be an object with a string `role`.", where)
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise ApiError(f"`{where}.content` parts must be text parts.", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise ApiError(f"`{where}.content` must be a string or text parts.", f"{where}.content")
    return {**message, "content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The token counts; `cached_tokens`: the prompt's tokens found in shared pages."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice(
    ask: Ask, index: int, text: str | None, reason: str, logprobs: Any = None,
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One choice of a whole answer: its `text`, why it ended, its `logprobs` object if asked;
    a chat's tool `calls` if it made any (its finish reason then "tool_calls")."""
    if not ask.chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"], reason = calls, "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def response(ask: Ask, choices: list[dict[str, Any]], counts: Sequence[int]) -> dict[str, Any]:
    """The whole answer to `ask`: its `choices` (`choice`), `counts` (prompt, completion and
    cached tokens)."""
    if ask.chat:
        head = {"id": f"chatcmpl-{ask.id}", "object": "chat.completion"}
    else:
        head = {"id": f"cmpl-{ask.id}", "object": "text_completion"}
    return {
        **head,
        "created": ask.created,
        "model": ask.model,
        "choices": choices,
        "usage": usage(*counts),
    }


def chunk(
    ask: Ask,
    text: str | None,
    reason: str | None = None,
    role: bool = False,
    counts: Sequence[int] | None = None,
    logprobs: Any = None,
    index: int = 0,
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice `index`: new `text` (and its tokens' `logprobs` object if
    asked), or the role (a chat's first), or the end (`reason`), or the usage alone (`counts`,
    no choices); a chat's tool `calls`, whole, with its end."""
    if ask.chat:
        head = {"id": f"chatcmpl-{ask.id}", "object": "chat.completion.chunk"}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            reason = "tool_calls"
        part: dict[str, Any] = {"delta": delta}
    else:
        head = {"id": f"cmpl-{ask.id}", "object": "text_completion"}
        part = {"text": text or ""}
    body: dict[str, Any] = {**head, "created": ask.created, "model": ask.model}
    if counts is not None:
        return {**body, "choices": [], "usage": usage(*counts)}
    body["choices"] = [{"index": index, **part, "logprobs": logprobs, "finish_reason": reason}]
    if ask.include_usage:
        body["usage"] = None
    return body
