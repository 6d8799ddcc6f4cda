"""The `dense-armor` command.

dense-armor export CHECKPOINT_DIR --out DIR [--static B,T[,S] ...] [--capacity N]
                   [--platforms cpu,cuda,tpu] [--force] [--temperature T] [--top-k K]
                   [--top-p P] [--min-p P]
dense-armor compile DIR [--target llvm-cpu[,cuda,vulkan-spirv]] [--cpu host] [--cuda-arch sm_80]
                    [--functions init_cache,sample_prefill,sample_step]
dense-armor runner DIR [--plugin PLUGIN.so] [--steps N] [--repeat R] [--tolerance T] [--cc CC]
dense-armor inspect DIR
dense-armor import-torch STATE.safetensors --config CONFIG.json --out CHECKPOINT_DIR
                         [--embed NAME] [--head NAME]
dense-armor import-hf HF_MODEL_DIR --out CHECKPOINT_DIR
dense-armor export-hf CHECKPOINT_DIR --out HF_MODEL_DIR [--architecture Qwen3ForCausalLM]
dense-armor generate CHECKPOINT_DIR (--prompt TEXT | --ids 1,2,3) [--tokenizer tokenizer.json]
                     [--max-new-tokens 32] [--temperature 0] [--top-k K] [--top-p P]
                     [--min-p P] [--stop 2,...] [--seed 0]
dense-armor serve CHECKPOINT_DIR [--input FILE] [--slots 8] [--capacity N] [--chunk 16]
                  [--tokenizer tokenizer.json] [--max-new-tokens 32] [--temperature 0]
                  [--top-k K] [--top-p P] [--min-p P] [--stop 2,...] [--seed 0]
"""

import argparse
import datetime
import json
import pathlib
import shutil
import sys
from collections.abc import Sequence
from typing import Any


def _shape(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected B,T (or B,T,S for a decoder); got {text!r}")
    return sizes


def _ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3; got {text!r}") from None


class UsageError(Exception):
    """A command's settings that its library call refused (`ValueError`), reported in one line."""


def _platforms(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _read_config(path: pathlib.Path) -> dict:
    from .interop import InteropError

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InteropError(f"cannot read the config {path}: {error}") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: the config must be a JSON object with factory and arguments.")
    return data


def _inspect(directory: pathlib.Path) -> str:
    from .export.standalone import load

    manifest = load(directory).manifest  # the sha256 of every file, and the manifest's claims
    model = manifest["model"]
    lines = [
        f"{directory}: dense_armor artifact, format version {manifest['format_version']}",
        f"  made with dense_armor {manifest['versions']['dense_armor']}, jax "
        f"{manifest['versions']['jax']}, jaxlib {manifest['versions']['jaxlib']}",
        f"  model: {model['factory']}({json.dumps(model['arguments'], sort_keys=True)})",
        f"  weights: {len(manifest['weights']['names'])} arrays in {manifest['weights']['file']}",
    ]
    for name, spec in manifest["functions"].items():
        inputs = [i for i in spec["inputs"] if i["role"] != "weight"]
        signature = ", ".join(f"{i['name']}: {i['dtype']}{tuple(i['shape'])}" for i in inputs)
        outputs = ", ".join(
            f"{o['name']}: {o['dtype']}{tuple(o['shape'])}" for o in spec["outputs"]
        )
        lines.append(f"  {name} [{', '.join(spec['platforms'])}] ({spec['file']})")
        lines.append(f"    (weights..., {signature})")
        lines.append(f"    -> ({outputs})")
        if spec.get("donated"):
            lines.append(f"    donated: the {len(spec['donated'])} cache arrays")
    streaming = manifest["streaming"]
    lines.append(
        f"  cache: {len(streaming['layout'])} arrays, capacity {streaming['capacity']}; "
        f"overflow: {streaming['overflow']}"
    )
    lines.append(f"  static modules: {len(manifest['static'])} (text and bytecode) in static/")
    compiled = manifest.get("compiled", [])
    if compiled:
        targets = sorted({c["target"] for c in compiled})
        lines.append(f"  IREE modules: {len(compiled)} (.vmfb) for {', '.join(targets)}")
    compatibility = manifest["compatibility"]
    until = compatibility["newer_jax_guaranteed_until"]
    lines.append(
        f"  compatibility: serialization version {compatibility['serialization_version']}, "
        f"exported with jax {compatibility['exported_with_jax']} on "
        f"{compatibility['exported_on']}; a newer jax is guaranteed to load it until {until}"
    )
    if datetime.date.fromisoformat(until) < datetime.date.today():
        lines.append(
            f"  warning: {until} has passed: a jax newer than "
            f"{compatibility['exported_with_jax']} may refuse these files; export again"
        )
    total = sum(f["bytes"] for f in manifest["files"].values())
    lines.append(f"  files: {len(manifest['files'])}, {total / 1024:.1f} KiB, all sha256 verified")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dense-armor", description="dense_armor tools")
    commands = parser.add_subparsers(dest="command", required=True)

    ex = commands.add_parser("export", help="export a checkpoint to StableHLO artifacts")
    ex.add_argument("checkpoint", type=pathlib.Path, help="checkpoint directory")
    ex.add_argument("--out", type=pathlib.Path, required=True, help="artifact directory to write")
    ex.add_argument(
        "--static",
        type=_shape,
        action="append",
        metavar="B,T[,S]",
        help="a shape for the static modules (S: a decoder's context length); repeat for more "
        "(default: 1,max_len and 8,max_len)",
    )
    ex.add_argument("--capacity", type=int, help="cache capacity of the step (default: max_len)")
    ex.add_argument("--platforms", type=_platforms, default=["cpu", "cuda", "tpu"])
    ex.add_argument("--force", action="store_true", help="replace --out if it exists")
    ex.add_argument(
        "--matmul-precision",
        choices=["highest", "default"],
        default="highest",
        help="float32 products: full precision everywhere (highest), or the platform's own "
        "(default: TF32 on NVIDIA GPUs)",
    )
    # a language model's sample_prefill and sample_step: greedy unless one of these is given
    ex.add_argument("--temperature", type=float, help="language models: sampling in the graph")
    ex.add_argument("--top-k", type=int)
    ex.add_argument("--top-p", type=float)
    ex.add_argument("--min-p", type=float)

    co = commands.add_parser(
        "compile", help="compile an artifact's static modules with IREE and check them"
    )
    co.add_argument("directory", type=pathlib.Path)
    co.add_argument("--target", type=_platforms, default=["llvm-cpu"], metavar="T[,T...]")
    co.add_argument("--cpu", default="host", help="llvm-cpu: the CPU to tune for (host, generic)")
    co.add_argument("--cuda-arch", default="sm_80", help="cuda: the GPU architecture")
    co.add_argument(
        "--functions", type=_platforms, default=None, metavar="F[,F...]",
        help="only these exported functions' modules (default all)",
    )  # fmt: skip

    ru = commands.add_parser(
        "runner", help="build an artifact's C runner and check it from C through a PJRT plugin"
    )
    ru.add_argument("directory", type=pathlib.Path)
    ru.add_argument("--plugin", type=pathlib.Path, help="the PJRT plugin (xla-cpu-pjrt's)")
    ru.add_argument(
        "--steps",
        type=int,
        help="steps of each stream (the golden ones); past them the last input repeats and each "
        "step is checked against the overflow contract",
    )
    ru.add_argument("--repeat", type=int, default=1, help="run each stream R times (latency)")
    ru.add_argument("--tolerance", type=float, help="largest error accepted (as run.py's)")
    ru.add_argument("--cc", help="the C compiler ($CC, cc, gcc or clang)")

    it = commands.add_parser(
        "import-torch", help="import a PyTorch Transformer state dict into a checkpoint"
    )
    it.add_argument("state", type=pathlib.Path, help="the state dict, as safetensors")
    it.add_argument(
        "--config",
        type=pathlib.Path,
        required=True,
        help='the model\'s config JSON: {"factory": ..., "arguments": {...}}',
    )
    it.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint directory")
    it.add_argument("--embed", default="embed", help="the input Linear's name (embed)")
    it.add_argument("--head", default="head", help="the output Linear's name (head)")

    hf = commands.add_parser(
        "import-hf", help="import a Hugging Face causal LM directory (see ARCHITECTURES)"
    )
    hf.add_argument("directory", type=pathlib.Path, help="config.json and model.safetensors")
    hf.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint directory")
    back = commands.add_parser(
        "export-hf", help="write a language-model checkpoint as a Hugging Face directory"
    )
    back.add_argument("checkpoint", type=pathlib.Path, help="a checkpoint of a TransformerLM")
    back.add_argument("--out", type=pathlib.Path, required=True, help="the directory to write")
    back.add_argument(
        "--architecture", help="e.g. Qwen3ForCausalLM (default: the one it was imported from)"
    )

    _add_generate(commands)
    _add_serve(commands)

    ins = commands.add_parser("inspect", help="print an artifact's manifest and verify its files")
    ins.add_argument("directory", type=pathlib.Path)

    return parser


def _add_generate(commands: Any) -> None:
    """The `generate` command's arguments."""
    ge = commands.add_parser("generate", help="generate from a language model checkpoint")
    ge.add_argument("checkpoint", type=pathlib.Path, help="a transformer_lm checkpoint")
    prompt = ge.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt's text (needs a tokenizer)")
    prompt.add_argument("--ids", type=_ids, help="the prompt's token ids, comma separated")
    _add_sampling(ge)


def _add_sampling(parser: Any) -> None:
    """The sampling settings `generate` and `serve` share."""
    parser.add_argument(
        "--tokenizer", type=pathlib.Path, help="a tokenizer.json (default: the checkpoint's)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--stop", type=_ids, default=[], help="stop tokens, comma separated")
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed")


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
    _add_sampling(se)


def _export(args: argparse.Namespace) -> None:
    from .export import export_checkpoint

    summary = export_checkpoint(
        args.checkpoint,
        args.out,
        capacity=args.capacity,
        platforms=args.platforms,
        static_shapes=args.static,
        force=args.force,
        matmul_precision=args.matmul_precision,
        sampling=_export_sampling(args),
    )
    print(summary)


def _export_sampling(args: argparse.Namespace) -> dict[str, Any] | None:
    """`export`'s sampling options that were given, or None (greedy)."""
    given = {
        name: getattr(args, name)
        for name in ("temperature", "top_k", "top_p", "min_p")
        if getattr(args, name) is not None
    }
    return given or None


def _compile(args: argparse.Namespace) -> None:
    from .export.iree import compile_artifact
    from .export.standalone import check_iree

    print(
        compile_artifact(
            args.directory,
            args.target,
            cpu=args.cpu,
            cuda_arch=args.cuda_arch,
            functions=args.functions,
        )
    )
    if "llvm-cpu" in args.target:
        print("checked with iree-run-module against the golden outputs:")
        for name, error in check_iree(args.directory).items():
            print(f"  {name:<40} max |error| = {error:.3e}")


def _runner(args: argparse.Namespace) -> int:
    from .export.standalone import run_pjrt

    done = run_pjrt(
        args.directory, args.plugin, args.steps, args.repeat, args.tolerance, cc=args.cc
    )
    print(done.stdout, end="")
    print(done.stderr, end="", file=sys.stderr)
    return done.returncode


def _import_torch(args: argparse.Namespace) -> None:
    from .checkpoint import CheckpointError, ModelConfig, save_checkpoint
    from .interop import InteropError, import_torch

    data = _read_config(args.config)
    missing = [key for key in ("factory", "arguments") if key not in data]
    if missing:
        raise InteropError(
            f"{args.config}: the config lacks {', '.join(map(repr, missing))}; it must "
            'be {"factory": ..., "arguments": {...}}.'
        )
    try:
        config = ModelConfig(data["factory"], data["arguments"])
    except CheckpointError as error:
        raise InteropError(f"{args.config}: {error}") from None
    model = import_torch(args.state, config, {"embed": args.embed, "head": args.head})
    print(f"imported {args.state} into {save_checkpoint(args.out, model, config)}")


def _import_hf(args: argparse.Namespace) -> None:
    from .checkpoint import ModelConfig, save_checkpoint
    from .huggingface import import_hf
    from .huggingface.writing import TOKENIZER_FILES

    model, arguments = import_hf(args.directory)
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
    import json

    from .checkpoint import load_checkpoint
    from .huggingface import HuggingFaceError, export_hf

    checkpoint = load_checkpoint(args.checkpoint)
    if checkpoint.config.factory != "transformer_lm":
        raise UsageError(
            f"{args.checkpoint} holds a {checkpoint.config.factory}, not a language model."
        )
    source_path = args.checkpoint / "huggingface" / "config.json"
    source = json.loads(source_path.read_text()) if source_path.is_file() else None
    architecture = args.architecture or ((source or {}).get("architectures") or [None])[0]
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

    model, tokenizer = _language_model(args)
    where = str(args.input) if args.input else "standard input"
    lines = args.input.read_text().splitlines() if args.input else sys.stdin.read().splitlines()
    try:
        requests = read_requests(lines, tokenizer, args.max_new_tokens, where)
        server = Server(
            model, args.slots, args.capacity, jax.random.PRNGKey(args.seed),
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, stop_tokens=args.stop, chunk=args.chunk,
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
    settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    try:
        tokens = stream_tokens(
            model, ids, args.max_new_tokens, jax.random.PRNGKey(args.seed),
            min_p=args.min_p, stop_tokens=args.stop, **settings,
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
    "export": _export,
    "import-hf": _import_hf,
    "export-hf": _export_hf,
    "generate": _generate,
    "serve": _serve,
    "compile": _compile,
    "runner": _runner,
    "import-torch": _import_torch,
    "inspect": lambda args: print(_inspect(args.directory)),
}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `dense-armor export | compile | runner | import-torch | import-hf |
    generate | serve | inspect`; exit 2 with one line naming the error for what a user can fix
    (`runner`: the C runner's own status, 1 for errors beyond the tolerance)."""
    args = _parser().parse_args(argv)
    from .checkpoint import CheckpointError
    from .export import ArtifactError
    from .huggingface import HuggingFaceError
    from .interop import InteropError

    try:
        status = COMMANDS[args.command](args)
    except (
        ArtifactError,
        CheckpointError,
        InteropError,
        HuggingFaceError,
        UsageError,
        OSError,
    ) as error:
        print(f"dense-armor {args.command}: error: {error}", file=sys.stderr)
        return 2
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
