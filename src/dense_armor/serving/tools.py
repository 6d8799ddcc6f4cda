"""Tool calls: a chat's `tools` and `tool_choice` checked (`check_tools`), the tool calls a model
writes parsed into OpenAI's `tool_calls` (`parse_calls`, one parser per format), and the grammar
that makes `tool_choice` `"required"` or a named function obeyed (`call_grammar`, for
`grammar.Grammars.lark`).

The formats (`FORMATS`), as their model families write them:

- `"hermes"` (Hermes, Qwen 2.5-3.x): each call `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, any text around them the message's content;
- `"llama3"` (Llama 3.1-3.3's JSON tool calling): the whole message one JSON object
  `{"name": ..., "parameters": {...}}` (`"arguments"` read too), after an optional
  `<|python_tag|>`, several separated by `;`;
- `"mistral"`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`, any text
  before it the content.

Text that does not parse as calls of the request's tools is the message's content, as written.
"""

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

from .errors import ApiError

__all__ = ["FORMATS", "Tools", "call_grammar", "check_tools", "format_of", "parse_calls"]

FORMATS = ("hermes", "llama3", "mistral")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class Tools:
    """A chat's tools: `specs` (as given, for the chat template), each function's `parameters`
    schema by name (`functions`), `choice` (`"auto"`, `"none"`, `"required"`, or a function's
    name) and whether several calls may come at once (`parallel`)."""

    specs: list[dict[str, Any]]
    functions: dict[str, dict[str, Any]]
    choice: str
    parallel: bool = True


def format_of(tokenizer: Any) -> str:
    """The format a checkpoint's family writes calls in, by its tokenizer's special tokens:
    Mistral's `[TOOL_CALLS]`, Llama 3's `<|python_tag|>`, else Hermes' (Qwen's `<tool_call>`)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "[TOOL_CALLS]" in vocab:
        return "mistral"
    return "llama3" if "<|python_tag|>" in vocab else "hermes"


def check_tools(body: Mapping[str, Any]) -> Tools | None:
    """A chat's `tools`, `tool_choice` and `parallel_tool_calls`, checked (`ApiError` naming
    the field); None without tools."""
    specs, choice = body.get("tools"), body.get("tool_choice")
    if specs in (None, []):
        if choice not in (None, "none", "auto"):
            raise ApiError("`tool_choice` needs `tools`.", "tool_choice")
        return None
    if not isinstance(specs, list):
        raise ApiError("`tools` must be a list of function tools.", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, spec in enumerate(specs):
        function = spec.get("function") if isinstance(spec, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        kind = spec.get("type") if isinstance(spec, Mapping) else None
        if kind != "function" or not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(
                f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": "
                "...}}}, the name of letters, digits, _ and - (64 at most).", f"tools[{i}]",
            )  # fmt: skip
        assert isinstance(function, Mapping)  # (its name was read from it)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, Mapping) or name in functions:
            raise ApiError(
                f"`tools[{i}]`: a function's `parameters` is a JSON schema object, and each "
                "name is given once.", f"tools[{i}]",
            )  # fmt: skip
        functions[name] = dict(parameters)
    return Tools(list(specs), functions, _choice(choice, functions),
                 body.get("parallel_tool_calls") is not False)  # fmt: skip


def _choice(choice: Any, functions: Mapping[str, Any]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return str(choice)
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or name is None:
        raise ApiError(
            '`tool_choice` must be "auto", "none", "required" or {"type": "function", '
            '"function": {"name": ...}}.', "tool_choice",
        )  # fmt: skip
    if name not in functions:
        raise ApiError(
            f"`tool_choice` names `{name}`, which is not among the tools.", "tool_choice"
        )
    return str(name)


def _call_schema(name: str, parameters: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: dict(parameters)},
        "required": ["name", key],
        "additionalProperties": False,
    }


def call_grammar(tools: Tools, form: str) -> str | None:
    """The Lark grammar (llguidance's, JSON schemas inline) of the calls `tools.choice` demands
    in `form`: any of the functions (`"required"`) or the one named, one call or (`parallel`)
    several; None where nothing is demanded (`"auto"`, `"none"`)."""
    if tools.choice in ("auto", "none"):
        return None
    names = list(tools.functions) if tools.choice == "required" else [tools.choice]
    key = "parameters" if form == "llama3" else "arguments"
    compact = {"x-guidance": {"whitespace_flexible": False}}  # no whitespace between tokens
    one = {"anyOf": [_call_schema(n, tools.functions[n], key) for n in names], **compact}
    several = tools.parallel and tools.choice == "required"
    if form == "mistral":
        most = {} if several else {"maxItems": 1}
        array = {"type": "array", "items": one, "minItems": 1, **most, **compact}
        return f'start: "[TOOL_CALLS]" body\nbody: %json {json.dumps(array)}\n'
    if form == "llama3":
        calls = 'body (";" body)*' if several else "body"
        return f"start: {calls}\nbody: %json {json.dumps(one)}\n"
    calls = "call+" if several else "call"
    return (
        f'start: {calls}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
        f"body: %json {json.dumps(one)}\n"
    )


def parse_calls(text: str, form: str, tools: Tools) -> tuple[str | None, list[dict[str, Any]]]:
    """`text` as the message's content and its tool calls (OpenAI's objects: `id`, `type`,
    `function` with `name` and `arguments`, a JSON string), in `form`; no calls where the text
    holds none that name the request's tools."""
    found: list[tuple[str, Any]] | None
    content: str | None = text
    if form == "hermes":
        pieces = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
        found = _calls([_json(p) for p in pieces], "arguments")
        content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip() or None
    elif form == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        items = _json(tail.strip()) if marker else None
        found = _calls(items if isinstance(items, list) else [None], "arguments")
        content = head.strip() or None
    else:
        body = text.strip().removeprefix("<|python_tag|>")
        found = _calls([_json(p) for p in body.split(";")], "parameters")
        content = None
    if not found or any(name not in tools.functions for name, _ in found):
        return text, []
    calls = [
        {"id": f"call_{secrets.token_hex(12)}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}
        for name, arguments in found
    ]  # fmt: skip
    return content, calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls(items: list[Any], key: str) -> list[tuple[str, Any]] | None:
    """`(name, arguments)` of each call object (`key` or `"arguments"` its arguments); None if
    any is not one."""
    calls = []
    for item in items:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(key, item.get("arguments", {}))
        if not isinstance(arguments, Mapping):
            return None
        calls.append((item["name"], arguments))
    return calls
