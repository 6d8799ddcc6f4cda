"""The device lane: every artifact family exported on the CPU and on the machine at hand, replayed
on its accelerator through JAX (the artifact's own `run.py` check) and from C through the
platform's PJRT plugin, and a dated report under `docs/devices/` (rows of `family`, `runtime`,
`exported_on`, `max_error`, `tolerance`, `tokens_differ`, `ok`, and each step's latency).

On an accelerator machine, from the repository's root (docs/devices/README.md says how to bring
the project's dependencies as wheels to a machine that reaches no registry):

    python tests/device_lane.py all --plugin /path/to/libtpu.so --out docs/devices

which runs the phases below in turn, each in a process of its own (one program holds a TPU chip
at a time), the CPU's artifacts exported with JAX pinned to the CPU:

    python tests/device_lane.py export DIR        export every family here, for cpu and this
                                                  machine's platform
    python tests/device_lane.py jax DIR... --rows R   each artifact's golden check and its step's
                                                  latency through JAX, one process
    python tests/device_lane.py c DIR... --rows R --plugin P   each artifact's C runner
    python tests/device_lane.py serve --rows R      the serving rows (tests/device_serving.py)
    python tests/device_lane.py report R --out docs/devices    the JSON and Markdown report

The suite runs the same code on the CPU with the CPU plugin (tests/test_device_lane.py), so the
lane stays alive without an accelerator.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "data" / "hf"
ENCODER = {"n_in": 3, "d_model": 16, "n_heads": 2, "d_ff": 32, "depth": 2, "n_out": 4,
           "max_len": 16, "causal": True}  # fmt: skip
DECODER = {"n_in": 3, "d_model": 16, "n_heads": 2, "d_ff": 32, "depth": 1, "n_out": 4,
           "max_len": 16, "d_context": 5, "norm_first": True}  # fmt: skip
LM = {"vocab": 64, "d_model": 32, "n_heads": 4, "d_ff": 64, "depth": 2, "max_len": 32,
      "n_kv_heads": 2}  # fmt: skip
CAPACITY, LM_CAPACITY, PAST = 12, 24, 4  # each stream runs PAST steps beyond its capacity
# the serving rows' configurations (tests/device_serving.py): slots, cache, decoding steps per
# dispatch, and whether `warm_up` is timed
SERVING = "64:fixed:8,64:fixed:1,8:fixed:8:warm,64:paged:8,64:paged-gather:8,8:paged:8"
SERVING_SIZES = {"prompt": 128, "new": 128, "capacity": 256}
TINY_SERVING = (
    {"vocab": 64, "d_model": 32, "n_heads": 4, "d_ff": 64, "depth": 2, "n_kv_heads": 2},
    {"prompt": 8, "new": 8, "capacity": 32},
)


def _built(factory: str, arguments: dict[str, Any]) -> Callable[[], tuple[Any, Any]]:
    def build() -> tuple[Any, Any]:
        import jax

        from dense_armor.checkpoints import ModelConfig

        config = ModelConfig(factory, arguments)
        return config.build(jax.random.PRNGKey(3)), config

    return build


def _imported(name: str) -> Callable[[], tuple[Any, Any]]:
    def build() -> tuple[Any, Any]:
        from dense_armor.checkpoints import ModelConfig
        from dense_armor.huggingface import import_hf

        model, arguments = import_hf(HF / name)
        return model, ModelConfig("transformer_lm", arguments)

    return build


# name: (build, export options)
FAMILIES: dict[str, tuple[Callable[[], tuple[Any, Any]], dict[str, Any]]] = {
    "encoder": (_built("transformer_encoder", ENCODER), {}),
    "decoder with a context": (
        _built("transformer_decoder", DECODER), {"static_shapes": [(2, 5, 3)]}
    ),
    "scanned encoder": (_built("transformer_encoder", {**ENCODER, "scan_layers": True}), {}),
    "recurrent stack": (
        _built("transformer_encoder", {**ENCODER, "mixers": ["gru", "mingru"]}), {}
    ),
    "mixed stack": (
        _built("transformer_encoder", {**ENCODER, "depth": 3,
                                       "mixers": ["mingru", "attention", "lstm"]}), {},
    ),
    "windowed encoder": (_built("transformer_encoder", {**ENCODER, "window": 3}), {}),
    "language model, greedy": (_built("transformer_lm", LM), {}),
    "language model, sampled": (
        _built("transformer_lm", LM), {"sampling": {"temperature": 0.8, "top_k": 8}}
    ),
    "language model, int8 weights": (_built("transformer_lm", {**LM, "quantize": "int8"}), {}),
    "language model, int8 cache": (_built("transformer_lm", LM), {"kv_dtype": "int8"}),
    "mixture of experts (Qwen3-MoE)": (_imported("qwen3_moe"), {}),
    "Qwen3.5 hybrid": (_imported("qwen3_5"), {}),
    "LFM2 hybrid": (_imported("lfm2"), {}),
}  # fmt: skip


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def export(out: pathlib.Path, names: Sequence[str], platforms: Sequence[str]) -> None:
    """Every family in `names` exported into `out/<slug>` by this process's JAX, for
    `platforms`; `out/exported.json` says on which backend."""
    import jax

    from dense_armor.export import export_model

    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        build, options = FAMILIES[name]
        model, config = build()
        lm = config.factory == "transformer_lm"
        shapes = options.get("static_shapes", [(1, 5)] if lm else [(2, 5)])
        export_model(
            model, config, out / slug(name), capacity=LM_CAPACITY if lm else CAPACITY,
            platforms=list(platforms), static_shapes=shapes, force=True,
            **{k: v for k, v in options.items() if k != "static_shapes"},
        )  # fmt: skip
        print(f"exported {name} on {jax.default_backend()}", flush=True)
    info = {"exported_on": jax.default_backend(), "families": {slug(n): n for n in names}}
    (out / "exported.json").write_text(json.dumps(info, indent=1))


def _steps(manifest: dict[str, Any]) -> int:
    """Past the capacity: the overflow contract checked too."""
    return int(manifest["streaming"]["capacity"]) + PAST


def _row(
    directory: pathlib.Path, runtime: str, errors: dict[str, float], platform: str
) -> dict[str, Any]:
    manifest = json.loads((directory / "manifest.json").read_text())
    info = json.loads((directory.parent / "exported.json").read_text())
    from dense_armor.export.standalone import checkers_tolerance  # run.py's own rule

    tolerance = checkers_tolerance(manifest, platform)
    differ = [v for k, v in errors.items() if "tokens that differ" in k]
    values = [v for k, v in errors.items() if "tokens that differ" not in k]
    worst = max(values, default=0.0)
    named = max((k for k in errors if "tokens that differ" not in k), key=errors.get, default="")
    return {
        "family": info["families"][directory.name], "runtime": runtime,
        "exported_on": info["exported_on"], "max_error": worst, "tolerance": tolerance,
        "tokens_differ": int(sum(differ)), "ok": bool(worst <= tolerance and not any(differ)),
        "checks": len(errors), "worst": named,
    }  # fmt: skip


def _append(rows: pathlib.Path, row: dict[str, Any]) -> None:
    with open(rows, "a") as handle:
        handle.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def _run_py(directory: pathlib.Path) -> Any:
    """The artifact's own `run.py`, imported (its check is the deployment's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"run_{directory.name}", directory / "run.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def jax_step_us(artifact: Any, repeat: int = 50) -> float:
    """The median latency of the artifact's streaming step through JAX (the decoding step of a
    language model), its output back on the host each step as the C runner times it."""
    import jax
    import jax.numpy as jnp

    manifest = artifact.manifest
    decoding = "sample_step" in manifest["functions"]
    static = manifest["golden"]["static"]
    sizes = dict(static[0]["shape"]) if static else {"B": 1}
    batch = int(sizes["B"])
    starts = []  # init_cache's inputs at the static sizes: the streams, and a context if any
    for spec in artifact.inputs("init_cache"):
        shape = [int(sizes.get(d, 1)) if isinstance(d, str) else int(d) for d in spec["shape"]]
        starts.append(jnp.ones(shape, spec["dtype"]) if spec["role"] == "streams"
                      else jnp.zeros(shape, spec["dtype"]))  # fmt: skip
    cache = artifact.call("init_cache", *starts)
    if decoding:
        x, call = jnp.zeros((batch,), jnp.int32), artifact.sample_step
    else:
        (spec,) = artifact.inputs("step", "input")
        shape = [batch, *(int(s) for s in spec["shape"][1:])]
        x, call = jnp.zeros(shape, spec["dtype"]), artifact.step
    times = []
    for i in range(repeat + 3):
        begin = time.perf_counter()
        y, cache, _ = call(x, cache)
        np.asarray(y)
        if i >= 3:
            times.append((time.perf_counter() - begin) * 1e6)
        if decoding:
            x = y
    jax.block_until_ready(cache)
    return statistics.median(times)


def check_jax(directories: Sequence[pathlib.Path], rows: pathlib.Path) -> None:
    import jax

    here = jax.default_backend()
    for directory in directories:
        run = _run_py(directory)
        artifact = run.load(directory)
        try:
            errors = run.check_golden(artifact, _steps(artifact.manifest))
            row = _row(directory, "jax", errors, here)
            row["step_us"] = round(jax_step_us(artifact), 1)
        except Exception as error:  # a runtime that cannot do it says so by name
            row = {**_row(directory, "jax", {}, here), "ok": False, "error": repr(error)[:300]}
        _append(rows, row)


RESULT = re.compile(r"^  (pjrt \S.*?)\s+max \|error\| = (\S+)", re.M)
PLATFORM = re.compile(r"on PJRT plugin .* \((\w+), PJRT C API")
LATENCY = re.compile(r"([0-9.]+) us per step")


def check_c(
    directories: Sequence[pathlib.Path], rows: pathlib.Path, plugin: str | None, runner: Any
) -> None:
    """Each artifact's C runner on the plugin (`runner`: a built binary, else built here)."""
    from dense_armor.export.standalone import build_runner, default_plugin

    plugin = plugin or str(default_plugin())
    if runner is None:
        runner = directories[0].parent / "runner"
        build_runner(directories[0], runner)
    for directory in directories:
        manifest = json.loads((directory / "manifest.json").read_text())
        command = [str(runner), str(directory), "--plugin", plugin,
                   "--steps", str(_steps(manifest))]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        errors = {k: float(v) for k, v in RESULT.findall(done.stdout)}
        on = PLATFORM.search(done.stdout)
        row = _row(directory, "c", errors, on.group(1) if on else "unknown")
        latencies = [float(v) for v in LATENCY.findall(done.stdout)]
        if latencies:
            row["step_us"] = latencies[-1]
        if done.returncode not in (0, 1) or not errors:
            row.update(ok=False, error=(done.stderr.strip() or done.stdout[-300:])[:300])
        _append(rows, row)


def machine() -> dict[str, Any]:
    """What ran the lane: the accelerator, JAX's and libtpu's versions, the host, the date."""
    import jax

    device = jax.devices()[0]
    versions = {"jax": jax.__version__, "python": platform.python_version()}
    for package in ("jaxlib", "libtpu", "xla_cpu_pjrt"):
        try:
            from importlib.metadata import version

            versions[package] = version(package.replace("_", "-"))
        except Exception:  # not installed here
            continue
    return {
        "platform": jax.default_backend(), "device": getattr(device, "device_kind", str(device)),
        "devices": jax.device_count(), "host": platform.machine(), "cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(), "versions": versions,
    }  # fmt: skip


def report(
    rows_file: pathlib.Path,
    out: pathlib.Path,
    name: str,
    info: dict[str, Any],
    note: str = "",
) -> None:
    """`out/NAME.json` (the machine and every row) and `out/NAME.md` (a table of them, after
    `note` if given: how the rows were made, when not by one `all`)."""
    every = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    rows = [r for r in every if "kind" not in r]
    serving = [r for r in every if "kind" in r]  # tests/device_serving.py's
    out.mkdir(parents=True, exist_ok=True)
    data = {"machine": info, "note": note, "rows": rows, "serving": serving}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    passed = sum(row["ok"] for row in rows)
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    lines = [
        f"# The device lane on {info['device']} ({info['platform']}), {info['date']}",
        "",
        f"{passed} of {len(rows)} rows ok. {versions}; {info['host']}, {info['cores']} cores. "
        "Made by the phases of tests/device_lane.py (`all` runs them in turn); each artifact ran "
        f"{PAST} steps past its capacity (the overflow contract checked).",
        *(["", note] if note else []),
        "",
        "| family | runtime | exported on | max error | tolerance | tokens that differ | step (us) "
        "| ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        step = f"{row['step_us']:.1f}" if "step_us" in row else ""
        ok = "yes" if row["ok"] else f"**no**: {row.get('error', 'past the tolerance')}"
        lines.append(
            f"| {row['family']} | {row['runtime']} | {row['exported_on']} | "
            f"{row['max_error']:.2e} | {row['tolerance']:.0e} | {row['tokens_differ']} | {step} "
            f"| {ok} |"
        )
    if serving:
        lines += ["", *serving_table(serving)]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def serving_table(rows: list[dict[str, Any]]) -> list[str]:
    """The serving rows as a Markdown table (tests/device_serving.py says what each holds)."""

    def cell(value: Any, form: str = "{:.0f}") -> str:
        return "" if value is None else form.format(value)

    lines = [
        "| model | what | slots | cache | steps per dispatch | new tokens/s (whole run) | "
        "decoding tokens/s | roofline tokens/s | share | warm_up (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        share = cell(r["share"] and 100 * r["share"], "{:.0f}%")
        lines.append(
            f"| {r.get('model', 'Llama-3.2-1B bfloat16')} | "
            f"{'Server' if r['kind'] == 'serve' else 'generate'} | {r['slots']} | "
            f"{r['cache']} | {cell(r['decode_steps'], '{}')} | {cell(r['tokens_per_s'])} | "
            f"{cell(r['decode_tokens_per_s'])} | {cell(r['roofline_tokens_per_s'])} | {share} | "
            f"{cell(r['warm_up_s'], '{:.0f}')}{' (restarted)' if r.get('restarted') else ''} |"
        )
    return lines


BEGIN, END = "<!-- device lane: begin -->", "<!-- device lane: end -->"


def readme_section(report_file: pathlib.Path) -> str:
    """The README's section of a report: one line per family, each runtime's largest error
    for the artifacts exported on each machine, and the step's latency from C against JAX's."""
    data = json.loads(report_file.read_text())
    info, rows = data["machine"], data["rows"]
    cell: dict[tuple[str, str, str], dict[str, Any]] = {
        (r["family"], r["exported_on"], r["runtime"]): r for r in rows
    }
    places = sorted({r["exported_on"] for r in rows}, key=lambda p: p != "cpu")
    head = " | ".join(f"exported on {p}: {rt}" for p in places for rt in ("jax", "c"))
    lines = [
        f"{sum(r['ok'] for r in rows)} of {len(rows)} checks pass on {info['device']} "
        f"({info['date']}, jax {info['versions'].get('jax')}): the largest error of each "
        "artifact's golden cases and decoding (tokens that differ in brackets when any), "
        "and its step's latency from C and from JAX ([docs/devices](docs/devices/README.md)).",
        "",
        f"| family | {head} | step from C / JAX (us) |",
        "| --- |" + " --- |" * (2 * len(places) + 1),
    ]
    for family in dict.fromkeys(r["family"] for r in rows):
        cells = []
        for place in places:
            for runtime in ("jax", "c"):
                r = cell.get((family, place, runtime))
                if r is None:
                    cells.append("")
                    continue
                mark = "" if r["ok"] else " **failed**"
                tokens = f" ({r['tokens_differ']})" if r["tokens_differ"] else ""
                cells.append(f"{r['max_error']:.1e}{tokens}{mark}")
        latency = ""
        for place in places:  # the last machine's artifact that ran through both
            c, j = cell.get((family, place, "c")), cell.get((family, place, "jax"))
            if c and j and "step_us" in c and "step_us" in j:
                latency = f"{c['step_us']:.0f} / {j['step_us']:.0f}"
        lines.append(f"| {family} | " + " | ".join(cells) + f" | {latency} |")
    if data.get("serving"):
        lines += ["", SERVING_LINE.format(**info), "", *serving_table(data["serving"])]
    return "\n".join(lines)


SERVING_LINE = (
    "Serving on {device}: a Llama-3.2-1B-shaped model in bfloat16, and a Llama-3.1-8B-shaped "
    "one with int8 projections (random weights, layers scanned: the model column), prompts of "
    "128 tokens and 128 new tokens each, greedy, against the roofline of "
    "the chip's memory bandwidth (the weights and the slots' key/value rows read once per "
    "decoding step; tests/device_serving.py)."
)


def write_readme(report_file: pathlib.Path, readme: pathlib.Path) -> None:
    """The README's text between `BEGIN` and `END` made anew from the report."""
    text = readme.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:start] + "\n" + readme_section(report_file) + "\n" + text[stop:])


def _phase(*arguments: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), *arguments]
    done = subprocess.run(command, env={**os.environ, **(env or {})}, timeout=3000)
    if done.returncode:
        raise SystemExit(f"device lane: {' '.join(arguments[:1])} failed ({done.returncode})")


def run_all(args: argparse.Namespace) -> None:
    """The phases in turn, each its own process (one program holds a TPU chip at a time)."""
    work = args.work
    rows = work / "rows.jsonl"
    rows.unlink(missing_ok=True)
    names = ",".join(slug(n) for n in FAMILIES if slug(n) in args.families)
    platforms = ",".join(args.platforms)
    _phase("export", str(work / "cpu"), "--families", names, "--platforms", platforms,
           env={"JAX_PLATFORMS": "cpu"})  # fmt: skip
    dirs = [str(work / "cpu")]
    if args.platforms != ["cpu"]:
        _phase("export", str(work / "here"), "--families", names, "--platforms", platforms)
        dirs.append(str(work / "here"))
    _phase("jax", *dirs, "--rows", str(rows), "--write-machine", str(work / "machine.json"))
    _phase("c", *dirs, "--rows", str(rows), *(["--plugin", args.plugin] if args.plugin else []))
    if args.platforms != ["cpu"]:  # an accelerator: the serving rows too
        _phase("serve", "--rows", str(rows))
    info = json.loads((work / "machine.json").read_text())
    report(rows, args.out, args.name or slug(f"{info['platform']} {info['device']}"), info)


def _artifacts(directories: Sequence[str], only: str | None = None) -> list[pathlib.Path]:
    """The artifacts of the `export` phases' directories (of the families `only` names, slugs
    separated by commas)."""
    found = []
    for directory in map(pathlib.Path, directories):
        info = json.loads((directory / "exported.json").read_text())
        found += [directory / s for s in info["families"] if not only or s in only.split(",")]
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    every = ",".join(map(slug, FAMILIES))
    ex = commands.add_parser("export")
    ex.add_argument("out", type=pathlib.Path)
    ex.add_argument("--families", default=every)
    ex.add_argument("--platforms", default="cpu,tpu")
    jx = commands.add_parser("jax")
    jx.add_argument("dirs", nargs="+")
    jx.add_argument("--rows", type=pathlib.Path, required=True)
    jx.add_argument("--write-machine", type=pathlib.Path)
    jx.add_argument("--only", help="these families (slugs, comma separated)")
    c = commands.add_parser("c")
    c.add_argument("dirs", nargs="+")
    c.add_argument("--rows", type=pathlib.Path, required=True)
    c.add_argument("--plugin")
    c.add_argument("--runner", type=pathlib.Path, help="a built runner (default: built here)")
    c.add_argument("--only", help="these families (slugs, comma separated)")
    al = commands.add_parser("all")
    al.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "devices")
    al.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/device-lane"))
    al.add_argument("--families", type=lambda s: s.split(","), default=list(map(slug, FAMILIES)))
    al.add_argument("--platforms", type=lambda s: s.split(","), default=["cpu", "tpu"])
    al.add_argument("--plugin")
    al.add_argument("--name", help="the report's file name (default: platform and device)")
    rp = commands.add_parser("report")
    rp.add_argument("rows", type=pathlib.Path)
    rp.add_argument("--machine", type=pathlib.Path, required=True, help="the jax phase's")
    rp.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "devices")
    rp.add_argument("--name", required=True)
    rp.add_argument("--note", default="", help="how the rows were made, if not by one `all`")
    sv = commands.add_parser("serve", help="the serving rows (tests/device_serving.py)")
    sv.add_argument("--rows", type=pathlib.Path, required=True)
    sv.add_argument(
        "--configs", default=SERVING, help="SLOTS:fixed|paged|paged-gather:STEPS[:warm],..."
    )
    sv.add_argument("--compile-cache", help="JAX's persistent compilation cache (a restart's)")
    sv.add_argument("--no-generate", action="store_true", help="the Server's rows only")
    sv.add_argument("--tiny", action="store_true", help="a tiny shape (the suite's, on a CPU)")
    sv.add_argument(
        "--shape", choices=("llama-1b", "llama-8b-int8"), default="llama-1b",
        help="Llama-3.2-1B's shape in bfloat16, or Llama-3.1-8B's with int8 projections",
    )  # fmt: skip
    sv.add_argument("--unrolled", action="store_true", help="the 1B shape's layers unrolled")
    sv.add_argument("--budget", type=float, default=420.0, help="no configuration started after")
    sv.add_argument(
        "--profile", type=pathlib.Path, help="trace one more run of each load and sum its events "
        "into DIR/SLOTS-CACHE-STEPS.json (tests/device_profile.py)",
    )  # fmt: skip
    rd = commands.add_parser("readme")
    rd.add_argument("report", type=pathlib.Path, nargs="?",
                    default=ROOT / "docs" / "devices" / "tpu-v5e.json")  # fmt: skip
    rd.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md")
    args = parser.parse_args(argv)
    if args.command == "export":
        wanted = args.families.split(",")
        families = [n for n in FAMILIES if slug(n) in wanted]
        export(args.out, families, args.platforms.split(","))
    elif args.command == "jax":
        if args.write_machine:
            args.write_machine.write_text(json.dumps(machine(), indent=1))
        check_jax(_artifacts(args.dirs, args.only), args.rows)
    elif args.command == "c":
        check_c(_artifacts(args.dirs, args.only), args.rows, args.plugin, args.runner)
    elif args.command == "report":
        info = json.loads(args.machine.read_text())
        report(args.rows, args.out, args.name, info, args.note)
    elif args.command == "serve":
        import device_serving

        shape, sizes = device_serving.LLAMA_1B, SERVING_SIZES
        if args.shape == "llama-8b-int8":
            shape = device_serving.LLAMA_8B_INT8
        if args.tiny:
            shape, sizes = TINY_SERVING
        if args.unrolled:
            shape = {**shape, "unrolled": True}
        configs = device_serving.parse(args.configs)
        if args.compile_cache:
            from dense_armor.serving.settings import enable_compile_cache

            enable_compile_cache(args.compile_cache)
        device_serving.run(
            args.rows, configs, shape, sizes, args.budget, not args.no_generate, args.profile
        )
    elif args.command == "readme":
        write_readme(args.report, args.readme)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
