"""`dense-armor serve`: a checkpoint's language model served with continuous batching, from JSON
lines on standard input or over HTTP (OpenAI's API, the `serve` extra)."""

import argparse
import importlib.util
import json
import pathlib
import sys
from typing import Any

from .common import UsageError, add_sampling, language_model, mesh_of, or_default

__all__ = ["COMMANDS", "add_commands"]


def _add_serve(commands: Any) -> None:
    """The `serve` command's arguments."""
    se = commands.add_parser(
        "serve",
        help="serve prompts (one per line, or JSON lines) from a language model checkpoint with "
        "continuous batching; one JSON line per answer, as each finishes",
    )
    se.add_argument("checkpoint", type=pathlib.Path, help="a transformer_lm checkpoint")
    se.add_argument(
        "--input", type=pathlib.Path, help="the requests (default: standard input): a line of "
        'text, or a JSON object {"prompt": TEXT} or {"ids": [...]}, with "max_new_tokens" '
        'and "id" if wanted',
    )  # fmt: skip
    se.add_argument("--slots", type=int, default=8, help="streams decoded together")
    se.add_argument("--capacity", type=int, help="cache slots per stream")
    se.add_argument("--chunk", type=int, default=16, help="prompt tokens per prefill call")
    se.add_argument(
        "--pages", type=int, help="a paged cache of this many pages shared by the slots (default: "
        "a whole cache of --capacity per slot)",
    )  # fmt: skip
    se.add_argument("--page-size", type=int, default=16, help="positions per page")
    se.add_argument(
        "--share-prefixes", action=argparse.BooleanOptionalAction, default=None,
        help="requests with a common prompt prefix share its pages (default: where the model's "
        "state is all keys and values)",
    )  # fmt: skip
    se.add_argument(
        "--decode-steps", type=int, help="decoding steps of every slot per dispatch (a "
        "request's tokens come back that many at a time; default 1)",
    )  # fmt: skip
    se.add_argument(
        "--max-logprobs", type=int, default=20, help="the most alternatives a request may ask "
        "with its tokens' log-probabilities (logprobs, top_logprobs; -1: no scores)",
    )  # fmt: skip
    http = se.add_argument_group("HTTP (OpenAI's API; pip install 'dense-armor[serve]')")
    http.add_argument("--http", action="store_true", help="serve HTTP instead of standard input")
    http.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    http.add_argument("--port", type=int, default=8000, help="the port (0: a free one)")
    http.add_argument("--max-queue", type=int, default=64, help="requests waiting at most (503)")
    http.add_argument("--name", help="the model's name in requests (default: the directory's)")
    http.add_argument(
        "--tool-parser", choices=("hermes", "llama3", "mistral"), help="how the model writes "
        "tool calls (default: by its tokenizer's special tokens: Mistral's [TOOL_CALLS], Llama "
        "3's <|python_tag|>, else Hermes' and Qwen's <tool_call>)",
    )  # fmt: skip
    se.add_argument(
        "--compile-cache", help="JAX's persistent compilation cache, where a restarted server "
        "finds its compiled functions (default: $JAX_COMPILATION_CACHE_DIR if set, else "
        "$XDG_CACHE_HOME/dense-armor/jax, ~/.cache/dense-armor/jax; 'none': off)",
    )  # fmt: skip
    add_sampling(se)


def _serve(args: argparse.Namespace) -> None:
    import jax

    from ..serving import Server, read_requests

    if args.http:  # the extra and the flags checked before the model is read and compiled
        _require_serve_extra()
        defaults = _request_defaults(args)
    _compile_cache(args.compile_cache)
    model, tokenizer = language_model(args)
    if args.http:
        return _serve_http(args, model, tokenizer, defaults)
    where = str(args.input) if args.input else "standard input"
    lines = args.input.read_text().splitlines() if args.input else sys.stdin.read().splitlines()
    try:
        requests = read_requests(lines, tokenizer, or_default(args.max_new_tokens, 32), where)
        server = Server(
            model, args.slots, args.capacity, jax.random.PRNGKey(args.seed),
            temperature=or_default(args.temperature, 0.0), top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, stop_tokens=args.stop, chunk=args.chunk, kv_dtype=args.kv_dtype,
            **_paging(args),
        )  # fmt: skip
        for i, request in enumerate(requests):
            try:
                server.submit(request["ids"], request["max_new"], id=request["id"])
            except ValueError as error:
                raise UsageError(f"request {i + 1} ({request['id']!r}): {error}") from None
        for done in server.run():
            answer = {"id": done.id, "ids": done.tokens.tolist(), "reason": done.reason}
            if tokenizer is not None:
                answer["text"] = tokenizer.decode(done.tokens.tolist())
            answer["time_to_first_token"] = round(done.time_to_first_token, 6)
            answer["latency"] = round(done.latency, 6)
            print(json.dumps(answer), flush=True)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from None


SERVE_EXTRA = ("starlette", "uvicorn", "jinja2", "prometheus_client", "tokenizers")


def _require_serve_extra() -> None:
    """`serve --http`'s packages (the `serve` extra), each found before anything else runs."""
    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"serve --http needs the serve extra ({', '.join(missing)} missing): "
            "pip install 'dense-armor[serve]'."
        )


def _serve_http(args: argparse.Namespace, model: Any, tokenizer: Any, defaults: Any) -> None:
    """`serve --http`: the OpenAI-compatible server on the checkpoint's model; prints the URL it
    listens on once it does."""
    import jax

    from ..serving import Server
    from ..serving.chat import ChatError, ChatTemplate
    from ..serving.http import create_app, serve_http
    from ..serving.tools import format_of

    if tokenizer is None:
        raise UsageError(
            f"serve --http needs a tokenizer: pass --tokenizer (none in {args.checkpoint})."
        )
    given = args.tokenizer
    where = args.checkpoint if given is None else given if given.is_dir() else given.parent
    try:
        template = ChatTemplate.from_directory(where)  # beside the tokenizer
    except ChatError:
        template = None  # the chat endpoint answers 400: no template
    try:
        server = Server(
            model, args.slots, args.capacity, jax.random.PRNGKey(args.seed),
            chunk=args.chunk, kv_dtype=args.kv_dtype, max_queue=args.max_queue, **_paging(args),
            structured=importlib.util.find_spec("llguidance") is not None,  # response_format
        )  # fmt: skip
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from None
    server.warm_up()  # every compilation now, before the first client waits for one
    name = args.name or args.checkpoint.resolve().name
    tool_format = args.tool_parser or format_of(tokenizer)
    app = create_app(
        server, tokenizer, name, template, _eos(args.checkpoint) + list(args.stop),
        defaults, tool_format,
    )  # fmt: skip
    try:
        serve_http(
            app, args.host, args.port, lambda url: print(f"serving {name} on {url}", flush=True)
        )
    except OSError as error:  # the address is taken, or not this machine's
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {error.strerror}") from None


def _compile_cache(given: str | None) -> None:
    from ..serving.settings import enable_compile_cache

    try:
        enable_compile_cache(given)
    except OSError as error:
        raise UsageError(f"--compile-cache {given or ''}: {error.strerror}") from None


def _request_defaults(args: argparse.Namespace) -> Any:
    """What an HTTP request that leaves a field out gets: the flag given, else OpenAI's default
    (checked as a request's own field is)."""
    from ..serving.protocol import ApiError, Defaults, parse_completion

    given = {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "max_tokens": args.max_new_tokens,
    }  # fmt: skip
    given = {name: value for name, value in given.items() if value is not None}
    try:  # the same ranges as a request's
        ask = parse_completion({"model": "-", "prompt": "-", **given}, 1)
    except ApiError as error:
        flag = {"max_tokens": "max-new-tokens"}.get(str(error.param), str(error.param))
        raise UsageError(f"--{flag.replace('_', '-')}: {error.message}") from None
    return Defaults(**{name: getattr(ask, name) for name in given})


def _eos(checkpoint: pathlib.Path) -> list[int]:
    """The end-of-sequence ids of an imported checkpoint (its generation config's, else its
    source config's): every HTTP request ends at them."""
    for path in (checkpoint / "generation_config.json", checkpoint / "huggingface" / "config.json"):
        if path.is_file():
            try:
                eos = json.loads(path.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
                raise UsageError(f"{path} is not a JSON object: {error}") from None
            if eos is not None:
                return [eos] if isinstance(eos, int) else [int(e) for e in eos]
    return []


def _paging(args: Any) -> dict[str, Any]:
    """The `Server`'s paged cache, dispatch and mesh options from `serve`'s arguments."""
    return dict(
        pages=args.pages, page_size=args.page_size, share_prefixes=args.share_prefixes,
        decode_steps=args.decode_steps, mesh=mesh_of(args.mesh),
        max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs,
    )  # fmt: skip


def add_commands(commands: Any) -> None:
    """`serve`'s parser."""
    _add_serve(commands)


COMMANDS = {"serve": _serve}
