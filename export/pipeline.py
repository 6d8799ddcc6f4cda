"""The main job: train the digits example (or reuse its checkpoint), export it, verify the export.

    python export/pipeline.py [--steps 1500] [--force-train] [--platforms cpu,cuda,tpu]

1. trains examples/digits.py into examples/runs/digits/ (resuming, or reusing a finished run),
   and the same model with recurrent and mixed blocks for its comparison of mixers;
2. exports its best checkpoint with the export stage into export/artifacts/ (replacing it);
3. compiles the static modules with IREE for llvm-cpu (`--iree-targets` for more);
4. runs the artifacts' standalone checker (`run.py`, jax + numpy + safetensors only) in a fresh
   interpreter, once through JAX, once through IREE's own runner (`run.py --iree`) and, where a C
   compiler and the `xla-cpu-pjrt` plugin are installed, once from C through the artifact's C
   runner on XLA's PJRT CPU plugin (`run.py --pjrt`);
5. prints a report: accuracy, artifact sizes, export and compile times, and the largest error of
   each exported function against the Python model, through JAX, IREE and the C runner.
"""

import argparse
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import time

from dense_armor.export import PLATFORMS, export_checkpoint
from dense_armor.export.iree import compile_artifact
from dense_armor.export.standalone import installed_cpu_plugin

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--runs", type=pathlib.Path, default=ROOT / "examples" / "runs" / "digits")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "artifacts")
    parser.add_argument("--force-train", action="store_true", help="discard the saved run first")
    parser.add_argument(
        "--eval-every", type=int, help="steps between validations (default: 20 in a training run)"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--platforms",
        default=",".join(PLATFORMS),
        help=f"comma-separated platforms to export for (default {','.join(PLATFORMS)})",
    )
    parser.add_argument(
        "--iree-targets",
        default="llvm-cpu",
        help="IREE targets to compile for (llvm-cpu is also run here; cuda, vulkan-spirv)",
    )
    args = parser.parse_args(argv)
    # The checker runs in the artifact's directory: every path it is given must hold from there.
    args.runs, args.out = args.runs.resolve(), args.out.resolve()

    started = time.perf_counter()
    if args.force_train and args.runs.exists():
        shutil.rmtree(args.runs)
    print(f"[1/4] training the digits example into {args.runs}", flush=True)
    training_args = ["--steps", str(args.steps), "--out", str(args.runs)]
    if args.eval_every is not None:
        training_args += ["--eval-every", str(args.eval_every)]
    report = load_example("digits").main(
        training_args + (["--no-progress"] if args.no_progress else [])
    )

    print(f"[2/4] exporting {args.runs / 'best'} to {args.out}", flush=True)
    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()]
    summary = export_checkpoint(args.runs / "best", args.out, force=True, platforms=platforms)
    print(summary, flush=True)

    targets = [t.strip() for t in args.iree_targets.split(",") if t.strip()]
    print(f"[3/4] compiling the static modules with IREE for {', '.join(targets)}", flush=True)
    compiled = compile_artifact(args.out, targets)
    print(compiled, flush=True)

    print("[4/4] checking the artifacts with their standalone runner (no dense_armor)", flush=True)
    errors = {}
    runtimes = [("jax", []), ("iree", ["--iree"])]
    compiler = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
    if compiler and installed_cpu_plugin() is not None:
        runtimes.append(("pjrt", ["--pjrt"]))
    else:
        print("  (the C runner's check skipped: it needs a C compiler and xla-cpu-pjrt)")
    for runtime, extra in runtimes:
        errors_file = args.out.parent / f".{args.out.name}-check-{runtime}.json"
        command = [sys.executable, str(args.out / "run.py"), str(args.out), *extra]
        checked = subprocess.run(
            [*command, "--report", str(errors_file)],
            capture_output=True,
            text=True,
            cwd=args.out,
        )
        print(checked.stdout, end="")
        if checked.returncode != 0:
            print(checked.stderr, file=sys.stderr)
            raise SystemExit(f"the standalone check of {args.out} through {runtime} failed")
        errors[runtime] = json.loads(errors_file.read_text())["errors"]
        errors_file.unlink()

    sizes = summary.files
    result = {
        "test_accuracy": report["test_accuracy"],
        "accuracy_by_rows": report["accuracy_by_rows"],
        "comparison": report["comparison"],
        "artifact_bytes": sum(sizes.values()),
        "portable_bytes": {k: v for k, v in sizes.items() if k.endswith(".jax_exported")},
        "static_modules": len([k for k in sizes if k.startswith("static/")]),
        "export_seconds": summary.seconds,
        "iree_modules": len(compiled.files),
        "compile_seconds": compiled.seconds,
        "errors": errors,
        "total_seconds": time.perf_counter() - started,
    }
    # Beside the artifacts, not in them: the directory holds what its manifest lists.
    report_file = args.out.parent / f"{args.out.name}-report.json"
    report_file.write_text(json.dumps(result, indent=2) + "\n")
    print("\nreport")
    print(f"  test accuracy           {result['test_accuracy']:.4f} (target 0.95)")
    print("  accuracy by rows seen   " + " ".join(f"{a:.2f}" for a in result["accuracy_by_rows"]))
    for row in result["comparison"]:
        print(
            f"    vs {row['model']:<20} test accuracy {row['test_accuracy']:.4f}, "
            f"{row['step_seconds'] * 1e6:.0f} us per step, {row['state_bytes']} state bytes"
        )
    print(
        f"  artifacts               {result['artifact_bytes'] / 1024:.0f} KiB in {args.out} "
        f"({result['static_modules']} static module files)"
    )
    for name, size in result["portable_bytes"].items():
        print(f"    {name:<22}{size / 1024:>8.1f} KiB ({', '.join(platforms)})")
    print(f"  export time             {result['export_seconds']:.1f} s")
    print(
        f"  IREE compile time       {result['compile_seconds']:.1f} s "
        f"({result['iree_modules']} .vmfb for {', '.join(targets)})"
    )
    print(f"  max |error| against the Python model   {'jax':>10} {'iree':>10} {'C, pjrt':>10}")
    for name, error in errors["jax"].items():
        print(f"    {name:<36} {error:>10.2e}")
    for name, error in errors["iree"].items():
        print(f"    {name:<36} {'':>10} {error:>10.2e}")
    for name, error in errors.get("pjrt", {}).items():
        print(f"    {name:<36} {'':>21} {error:>10.2e}")
    print(f"  total                   {result['total_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
