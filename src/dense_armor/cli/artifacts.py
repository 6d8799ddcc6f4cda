"""The `dense-armor` commands of artifacts: `export` (a checkpoint to StableHLO), `compile` (its
static modules by IREE), `runner` (its C runner on a PJRT plugin), `inspect`, and `import-torch`
(a PyTorch encoder's state dict into a checkpoint)."""

import argparse
import datetime
import json
import pathlib
import sys
from typing import Any

from .common import add_kv_dtype, model_axis


def _shape(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected B,T (or B,T,S for a decoder); got {text!r}")
    return sizes


def _platforms(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _read_config(path: pathlib.Path) -> dict:
    from ..interop import InteropError

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InteropError(f"cannot read the config {path}: {error}") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: the config must be a JSON object with factory and arguments.")
    return data


def _inspect(directory: pathlib.Path) -> str:
    from ..export.standalone import load

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
    if manifest.get("mesh"):
        mesh = manifest["mesh"]
        lines.append(f"  laid out over {mesh['devices']} devices: mesh {mesh['axes']}")
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


def add_commands(commands: Any) -> None:
    """The artifact commands' parsers: `export`, `compile`, `runner`, `import-torch`, `inspect`."""
    _add_export(commands)
    _add_compile(commands)
    _add_runner(commands)
    _add_import_torch(commands)
    _add_inspect(commands)


def _add_export(commands: Any) -> None:
    """`export`: a checkpoint to StableHLO artifacts."""
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
    add_kv_dtype(ex)
    ex.add_argument(
        "--mesh", type=model_axis, metavar="model=N", help="lay the modules out over N devices "
        "(heads and hidden units split; any machine exports, N devices run it)",
    )  # fmt: skip


def _add_compile(commands: Any) -> None:
    """`compile`: an artifact's static modules through IREE."""
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


def _add_runner(commands: Any) -> None:
    """`runner`: an artifact's C runner on a PJRT plugin."""
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


def _add_import_torch(commands: Any) -> None:
    """`import-torch`: a PyTorch Transformer's state dict."""
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


def _add_inspect(commands: Any) -> None:
    """`inspect`: an artifact's manifest and files."""
    ins = commands.add_parser("inspect", help="print an artifact's manifest and verify its files")
    ins.add_argument("directory", type=pathlib.Path)


def _export(args: argparse.Namespace) -> None:
    from ..export import export_checkpoint

    summary = export_checkpoint(
        args.checkpoint,
        args.out,
        capacity=args.capacity,
        platforms=args.platforms,
        static_shapes=args.static,
        force=args.force,
        matmul_precision=args.matmul_precision,
        sampling=_export_sampling(args),
        kv_dtype=args.kv_dtype,
        mesh=_export_mesh(args.mesh),
    )
    print(summary)


def _export_mesh(devices: int | None) -> Any:
    """`export --mesh model=N`: an abstract mesh of N devices (none are needed to export)."""
    if devices is None:
        return None
    from jax.sharding import AbstractMesh

    return AbstractMesh((1, devices), ("data", "model"))


def _export_sampling(args: argparse.Namespace) -> dict[str, Any] | None:
    """`export`'s sampling options that were given, or None (greedy)."""
    given = {
        name: getattr(args, name)
        for name in ("temperature", "top_k", "top_p", "min_p")
        if getattr(args, name) is not None
    }
    return given or None


def _compile(args: argparse.Namespace) -> None:
    from ..export.iree import compile_artifact
    from ..export.standalone import check_iree_with

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
        runner, errors = check_iree_with(args.directory, None, "local-task", "auto")
        print(f"checked in {runner} against the golden outputs:")
        for name, error in errors.items():
            print(f"  {name:<40} max |error| = {error:.3e}")


def _runner(args: argparse.Namespace) -> int:
    from ..export.standalone import run_pjrt

    done = run_pjrt(
        args.directory, args.plugin, args.steps, args.repeat, args.tolerance, cc=args.cc
    )
    print(done.stdout, end="")
    print(done.stderr, end="", file=sys.stderr)
    return done.returncode


def _import_torch(args: argparse.Namespace) -> None:
    from ..checkpoints.single import CheckpointError, ModelConfig, save_checkpoint
    from ..interop import InteropError, import_torch

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


COMMANDS = {
    "export": _export,
    "compile": _compile,
    "runner": _runner,
    "import-torch": _import_torch,
    "inspect": lambda args: print(_inspect(args.directory)),
}
