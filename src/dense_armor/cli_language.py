"""The `dense-armor` commands of language models: `import-hf`, `export-hf`, `generate` and
`serve` (their parsers and what they run), with the precision options each takes:
`import-hf --dtype bfloat16 --quantize int8 [--quantize-embeddings]`, and `--kv-dtype int8` for
`generate` and `serve` (and `export`, in `cli`)."""

import argparse
import importlib.util
import json
import pathlib
import shutil
import sys
from typing import Any

__all__ = ["COMMANDS", "UsageError", "add_commands", "add_kv_dtype", "ids"]

PARAM_DTYPES = ("float32", "bfloat16", "float16")  # nn.precision's, without importing JAX here
KV_DTYPES = ("float32", "bfloat16", "float16", "int8")


class UsageError(Exception):
    """A command's settings that its library call refused (`ValueError`), reported in one line."""


def ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3; got {text!r}") from None


def add_kv_dtype(parser: Any) -> None:
    parser.add_argument(
        "--kv-dtype", choices=KV_DTYPES, help="the cache's keys and values (int8: a quarter of "
        "float32's memory, a scale per head and position; default: the model's own dtype, "
        "bfloat16 for a bfloat16 model)",
    )  # fmt: skip


def add_commands(commands: Any) -> None:
    """The language-model commands' parsers."""
    _add_hf(commands)
    _add_generate(commands)
    _add_serve(commands)


def _add_hf(commands: Any) -> None:
    """`import-hf` and `export-hf`."""
    hf = commands.add_parser(
        "import-hf", help="import a Hugging Face causal LM directory (see ARCHITECTURES)"
    )
    hf.add_argument("directory", type=pathlib.Path, help="config.json and model.safetensors")
    hf.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint directory")
    hf.add_argument(
        "--dtype", choices=PARAM_DTYPES, default="float32",
        help="the weights' dtype (bfloat16: a bfloat16 checkpoint kept as stored)",
    )  # fmt: skip
    hf.add_argument("--quantize", choices=["int8"], help="the projections as int8, per channel")
    hf.add_argument(
        "--quantize-embeddings", action="store_true", help="with --quantize: the tables too"
    )
    back = commands.add_parser(
        "export-hf", help="write a language-model checkpoint as a Hugging Face directory"
    )
    back.add_argument("checkpoint", type=pathlib.Path, help="a checkpoint of a TransformerLM")
    back.add_argument("--out", type=pathlib.Path, required=True, help="the directory to write")
    back.add_argument(
        "--architecture", help="e.g. Qwen3ForCausalLM (default: the one it was imported from)"
    )


def _add_generate(commands: Any) -> None:
    """The `generate` command's arguments."""
    ge = commands.add_parser("generate", help="generate from a language model checkpoint")
    ge.add_argument("checkpoint", type=pathlib.Path, help="a transformer_lm checkpoint")
    prompt = ge.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt's text (needs a tokenizer)")
    prompt.add_argument("--ids", type=ids, help="the prompt's token ids, comma separated")
    _add_sampling(ge)


def _add_sampling(parser: Any) -> None:
    """The sampling settings `generate` and `serve` share."""
    parser.add_argument(
        "--tokenizer", type=pathlib.Path, help="a tokenizer.json (default: the checkpoint's)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help="new tokens per prompt (default 32; serve: the "
        "default of requests that set none, over HTTP the room left in the context)",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, help="0: greedy (the default, but over HTTP OpenAI's 1); "
        "serve: the default of requests that set none, as --top-k, --top-p and --min-p",
    )  # fmt: skip
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--stop", type=ids, default=[], help="stop tokens, comma separated")
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
    add_kv_dtype(parser)


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
    _add_sampling(se)


def _import_hf(args: argparse.Namespace) -> None:
    from .checkpoint import ModelConfig, save_checkpoint
    from .huggingface import import_hf
    from .huggingface.writing import TOKENIZER_FILES

    if args.quantize_embeddings and args.quantize is None:
        raise UsageError("--quantize-embeddings needs --quantize int8.")
    model, arguments = import_hf(
        args.directory, dtype=args.dtype, quantize=args.quantize,
        quantize_embeddings=args.quantize_embeddings,
    )  # fmt: skip
    written = save_checkpoint(args.out, model, ModelConfig("transformer_lm", arguments))
    # The tokenizer beside the checkpoint (where `generate` looks for `tokenizer.json`), and the
    # source config under `huggingface/`, for `export-hf` to write the model back
    for name in TOKENIZER_FILES:
        if (args.directory / name).is_file():
            shutil.copyfile(args.directory / name, written / name)
    (written / "huggingface").mkdir(exist_ok=True)
    shutil.copyfile(args.directory / "config.json", written / "huggingface" / "config.json")
    print(f"imported {args.directory} into {written}")


def _export_hf(args: argparse.Namespace) -> None:
    from .checkpoint import load_checkpoint
    from .huggingface import WRAPPERS, HuggingFaceError, export_hf, text_model

    checkpoint = load_checkpoint(args.checkpoint)
    if checkpoint.config.factory != "transformer_lm":
        raise UsageError(
            f"{args.checkpoint} holds a {checkpoint.config.factory}, not a language model."
        )
    source_path = args.checkpoint / "huggingface" / "config.json"
    source = json.loads(source_path.read_text()) if source_path.is_file() else None
    found = ((source or {}).get("architectures") or [None])[0]
    if source is not None and found in WRAPPERS:  # a multimodal source: its text model
        found, source = text_model(source)
    architecture = args.architecture or found
    if architecture is None:
        raise HuggingFaceError(
            f"{args.checkpoint} was not imported from Hugging Face: pass --architecture."
        )
    written = export_hf(
        checkpoint.model, checkpoint.config.arguments, args.out, architecture=architecture,
        source=source, tokenizer=args.checkpoint,
    )  # fmt: skip
    print(f"wrote {architecture} to {written}")


def _language_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The checkpoint's language model and its tokenizer (`--tokenizer`, else the checkpoint's
    `tokenizer.json` if it has one, else None)."""
    from .checkpoint import CheckpointError, load_checkpoint
    from .huggingface import load_tokenizer

    checkpoint = load_checkpoint(args.checkpoint)
    if checkpoint.config.factory != "transformer_lm":
        raise CheckpointError(
            f"{args.checkpoint} holds a {checkpoint.config.factory!r} model; {args.command} "
            "needs a 'transformer_lm' one."
        )
    path = args.tokenizer or args.checkpoint / "tokenizer.json"
    tokenizer = load_tokenizer(path) if args.tokenizer or path.is_file() else None
    return checkpoint.model, tokenizer


def _serve(args: argparse.Namespace) -> None:
    import jax

    from .serving import Server, read_requests

    if args.http:  # the extra and the flags checked before the model is read and compiled
        _require_serve_extra()
        defaults = _request_defaults(args)
    _compile_cache(args.compile_cache)
    model, tokenizer = _language_model(args)
    if args.http:
        return _serve_http(args, model, tokenizer, defaults)
    where = str(args.input) if args.input else "standard input"
    lines = args.input.read_text().splitlines() if args.input else sys.stdin.read().splitlines()
    try:
        requests = read_requests(lines, tokenizer, _or(args.max_new_tokens, 32), where)
        server = Server(
            model, args.slots, args.capacity, jax.random.PRNGKey(args.seed),
            temperature=_or(args.temperature, 0.0), top_k=args.top_k, top_p=args.top_p,
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

    from .serving import Server
    from .serving.chat import ChatError, ChatTemplate
    from .serving.http import create_app, serve_http
    from .serving.tools import format_of

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
    from .serving.settings import enable_compile_cache

    try:
        enable_compile_cache(given)
    except OSError as error:
        raise UsageError(f"--compile-cache {given or ''}: {error.strerror}") from None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _request_defaults(args: argparse.Namespace) -> Any:
    """What an HTTP request that leaves a field out gets: the flag given, else OpenAI's default
    (checked as a request's own field is)."""
    from .serving.protocol import ApiError, Defaults, parse_completion

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


def _generate(args: argparse.Namespace) -> None:
    import jax

    from .nn.models.generation import stream_tokens

    model, tokenizer = _language_model(args)
    path = args.tokenizer or args.checkpoint / "tokenizer.json"
    if args.prompt is None:
        ids = args.ids
    elif tokenizer is None:
        raise UsageError(f"--prompt needs a tokenizer: pass --tokenizer (none in {path.parent}).")
    else:
        ids = tokenizer.encode(args.prompt).ids
    settings = dict(temperature=_or(args.temperature, 0.0), top_k=args.top_k, top_p=args.top_p)
    try:
        tokens = stream_tokens(
            model, ids, _or(args.max_new_tokens, 32), jax.random.PRNGKey(args.seed),
            min_p=args.min_p, stop_tokens=args.stop, kv_dtype=args.kv_dtype, **settings,
        )  # fmt: skip
        shown, new = "", []
        for token in tokens:  # text as it comes: the decoded whole, less what is shown
            new.append(token)
            text = tokenizer.decode(new) if tokenizer is not None else " ".join(map(str, new))
            print(text[len(shown) :], end="", flush=True)
            shown = text
    except ValueError as error:
        raise UsageError(str(error)) from None
    print()


COMMANDS = {
    "import-hf": _import_hf,
    "export-hf": _export_hf,
    "generate": _generate,
    "serve": _serve,
}


def _paging(args: Any) -> dict[str, Any]:
    """The `Server`'s paged cache and dispatch options from `serve`'s arguments."""
    return dict(
        pages=args.pages, page_size=args.page_size, share_prefixes=args.share_prefixes,
        decode_steps=args.decode_steps,
        max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs,
    )  # fmt: skip
