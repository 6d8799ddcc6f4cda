"""What the language-model commands share: the usage error, token ids and dtypes as flags, the
sampling flags of `generate` and `serve`, and the checkpoint's model with its tokenizer."""

import argparse
import pathlib
from typing import Any

__all__ = [
    "UsageError",
    "add_kv_dtype",
    "add_sampling",
    "ids",
    "language_model",
    "mesh_of",
    "or_default",
]

PARAM_DTYPES = ("float32", "bfloat16", "float16")  # nn.precision's, without importing JAX here
KV_DTYPES = ("float32", "bfloat16", "float16", "int8")


class UsageError(Exception):
    """A command's settings that its library call refused (`ValueError`), reported in one line."""


def ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3; got {text!r}") from None


def model_axis(text: str) -> int:
    """`--mesh model=N`'s N, a positive integer."""
    name, _, count = text.partition("=")
    if name.strip() != "model" or not count.strip().isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected model=N (N devices, N >= 1); got {text!r}")
    return int(count)


def mesh_of(devices: int | None) -> Any:
    """The mesh of `--mesh model=N`: this machine's first N devices on a `"model"` axis (None
    without the flag); a `UsageError` when it has fewer."""
    if devices is None:
        return None
    import jax

    from ..distributed import device_mesh

    available = jax.devices()
    if devices > len(available):
        raise UsageError(
            f"--mesh model={devices}: this machine has {len(available)} "
            f"{available[0].platform} device(s)."
        )
    return device_mesh(model=devices, devices=available[:devices])


def add_kv_dtype(parser: Any) -> None:
    parser.add_argument(
        "--kv-dtype", choices=KV_DTYPES, help="the cache's keys and values (int8: a quarter of "
        "float32's memory, a scale per head and position; default: the model's own dtype, "
        "bfloat16 for a bfloat16 model)",
    )  # fmt: skip


def add_sampling(parser: Any) -> None:
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
    parser.add_argument(
        "--mesh", type=model_axis, metavar="model=N", help="split the model over N devices "
        "(tensor parallelism: its heads and hidden units, and the cache's key/value heads; "
        "default: one device)",
    )  # fmt: skip


def language_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The checkpoint's language model and its tokenizer (`--tokenizer`, else the checkpoint's
    `tokenizer.json` if it has one, else None)."""
    from ..checkpoints.single import CheckpointError, load_checkpoint
    from ..huggingface import load_tokenizer

    checkpoint = load_checkpoint(args.checkpoint)
    if checkpoint.config.factory != "transformer_lm":
        raise CheckpointError(
            f"{args.checkpoint} holds a {checkpoint.config.factory!r} model; {args.command} "
            "needs a 'transformer_lm' one."
        )
    path = args.tokenizer or args.checkpoint / "tokenizer.json"
    tokenizer = load_tokenizer(path) if args.tokenizer or path.is_file() else None
    return checkpoint.model, tokenizer


def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value
