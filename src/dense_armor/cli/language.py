"""The `dense-armor` commands of language models: `import-hf`, `export-hf` and `generate` (their
parsers and what they run), with the precision options each takes:
`import-hf --dtype bfloat16 --quantize int8 [--quantize-embeddings]`, and `--kv-dtype int8` for
`generate` (and `serve`, `export`)."""

import argparse
import json
import pathlib
import shutil
from typing import Any

from .common import (
    PARAM_DTYPES,
    UsageError,
    add_sampling,
    ids,
    language_model,
    mesh_of,
    or_default,
)

__all__ = ["COMMANDS", "add_commands"]


def add_commands(commands: Any) -> None:
    """The language-model commands' parsers."""
    _add_hf(commands)
    _add_generate(commands)


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
    add_sampling(ge)


def _import_hf(args: argparse.Namespace) -> None:
    from ..checkpoints.single import ModelConfig, save_checkpoint
    from ..huggingface import import_hf
    from ..huggingface.writing import TOKENIZER_FILES

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
    from ..checkpoints.single import load_checkpoint
    from ..huggingface import WRAPPERS, HuggingFaceError, export_hf, text_model

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


def _generate(args: argparse.Namespace) -> None:
    import jax

    from ..nn.models.generation import stream_tokens

    model, tokenizer = language_model(args)
    path = args.tokenizer or args.checkpoint / "tokenizer.json"
    if args.prompt is None:
        ids = args.ids
    elif tokenizer is None:
        raise UsageError(f"--prompt needs a tokenizer: pass --tokenizer (none in {path.parent}).")
    else:
        ids = tokenizer.encode(args.prompt).ids
    settings = dict(
        temperature=or_default(args.temperature, 0.0), top_k=args.top_k, top_p=args.top_p
    )
    try:
        tokens = stream_tokens(
            model, ids, or_default(args.max_new_tokens, 32), jax.random.PRNGKey(args.seed),
            min_p=args.min_p, stop_tokens=args.stop, kv_dtype=args.kv_dtype,
            mesh=mesh_of(args.mesh), **settings,
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
}
