"""Compile an artifact's static StableHLO modules with IREE, for deployment without JAX.

`compile_artifact(directory, targets=("llvm-cpu",))` runs IREE's compiler (`iree-compile`, from
the `iree-base-compiler` wheel: `pip install 'dense-armor[iree]'`) on every static module of an
artifact directory, for each target, and writes `static/<module>.<target>.vmfb` beside it; the
manifest lists each one (`compiled`: module, target, flags, compiler version) with its sha256.
The directory is rewritten atomically, like an export. Targets other than `llvm-cpu` are compiled
here and run on their own hardware; `llvm-cpu` modules are then checked on this machine with
IREE's own runner (`iree-run-module`), see `standalone.check_iree`.

A C or C++ deployment then needs IREE's runtime only: load the `.vmfb`, call `main` with the
module's kept inputs (the manifest's `static[i].kept_inputs` of `functions[f].inputs`: weights
first, in the order of `weights.names`), and feed the returned cache back into the next step.
"""

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import platform
import shutil
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..checkpoints import atomic
from ..nn.core import require_int
from .standalone import (
    MANIFEST,
    ArtifactError,
    file_table,
    read_manifest,
    require_one_device,
    verify_files,
)

__all__ = ["TARGETS", "CompileSummary", "compile_artifact", "host_cpu", "target_flags"]

TARGETS = ("llvm-cpu", "cuda", "vulkan-spirv")
# Every target: the constant expressions IREE hoists out of the functions (rotary tables, masks,
# iotas) computed once when the module loads rather than by a JIT-compiled program inside the
# compiler: 12-19% less compile CPU per module (7.7 -> 6.2 s for a tiny Llama's decoding, 14.6
# -> 12.8 s for Qwen3.5's), the same values (the golden checks unchanged), a load that is
# microseconds longer.
COMMON_FLAGS = ("--iree-opt-const-eval=false",)


def target_flags(target: str, cpu: str = "host", cuda_arch: str = "sm_80") -> list[str]:
    """`iree-compile`'s flags for one target. `cpu`: the CPU an `llvm-cpu` module is tuned for
    (`host`: this machine's instruction set, fastest here but may not run on an older CPU;
    `generic`: any x86-64 or AArch64; or a name such as `znver4`). `cuda_arch`: the GPU
    architecture of a `cuda` module. On x86-64, `host` is what the system enables (`host_cpu`)."""
    if target == "llvm-cpu":
        if not isinstance(cpu, str) or not cpu or cpu.startswith("-") or cpu != cpu.split()[0]:
            raise ArtifactError(
                f"`cpu` must be a CPU name such as 'host', 'generic' or 'znver4'; received {cpu!r}."
            )
        chosen = host_cpu() if cpu == "host" else [f"--iree-llvmcpu-target-cpu={cpu}"]
        return [
            "--iree-hal-target-device=local",
            "--iree-hal-local-target-device-backends=llvm-cpu",
            *chosen,
            *COMMON_FLAGS,
        ]
    if target == "cuda":
        return ["--iree-hal-target-device=cuda", f"--iree-cuda-target={cuda_arch}", *COMMON_FLAGS]
    if target == "vulkan-spirv":
        return ["--iree-hal-target-device=vulkan", *COMMON_FLAGS]
    raise ArtifactError(f"unknown IREE target {target!r}; known: {', '.join(TARGETS)}.")


# x86-64's microarchitecture levels (the psABI's), as /proc/cpuinfo names their features
X86_LEVELS = {
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
}
# the features beyond a level that IREE's code for products can use: /proc/cpuinfo's name, LLVM's
X86_EXTRA = {
    "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16",
    "avx512vbmi": "avx512vbmi", "avx512_vbmi2": "avx512vbmi2", "avx512ifma": "avx512ifma",
    "avx512_bitalg": "avx512bitalg", "avx512_vpopcntdq": "avx512vpopcntdq",
    "avx_vnni": "avxvnni", "amx_tile": "amx-tile", "amx_int8": "amx-int8", "amx_bf16": "amx-bf16",
    "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
}  # fmt: skip


def host_cpu(cpuinfo: str | None = None) -> list[str]:
    """The `llvm-cpu` flags for this machine: on x86-64, the highest microarchitecture level
    whose features the system enables, and the product features beyond it that it enables
    (`/proc/cpuinfo`'s flags, or `cpuinfo`'s text); elsewhere IREE's own `host`.

    Not IREE's `--iree-llvmcpu-target-cpu=host` on x86-64: it names the CPU by its model (a
    virtual machine's Zen 4 is `znver4`) and then takes the features the system enables, and
    where a virtual machine hides AVX-512 from a Zen 4 the two disagree and `iree-compile` (3.13)
    fails on an int8 product ("operations with large vector sizes"); IREE refuses a `host`
    feature list beside any CPU but `host`."""
    cpuinfo = _cpuinfo() if cpuinfo is None else cpuinfo
    if not isinstance(cpuinfo, str):
        raise TypeError(f"`cpuinfo` must be the text of /proc/cpuinfo; received {cpuinfo!r:.60}.")
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines()
                  if ln.startswith("flags")), None)  # fmt: skip
    if flags is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return ["--iree-llvmcpu-target-cpu=host"]
    have, level = set(flags), "x86-64"
    for name, needs in reversed(X86_LEVELS.items()):  # v2, then v3, then v4
        if not have >= needs:
            break
        level = name
    chosen = [f"--iree-llvmcpu-target-cpu={level}"]
    extra = [f"+{llvm}" for name, llvm in X86_EXTRA.items() if name in have]
    return chosen + ([f"--iree-llvmcpu-target-cpu-features={','.join(extra)}"] if extra else [])


def _compiler() -> Any:
    try:
        from iree.compiler import tools
    except ImportError:
        raise ArtifactError(
            "compiling with IREE needs its compiler: pip install 'dense-armor[iree]' "
            "(iree-base-compiler and iree-base-runtime)."
        ) from None
    return tools


@dataclasses.dataclass
class CompileSummary:
    """What `compile_artifact` wrote: each `.vmfb` and its size, and the time it took."""

    directory: pathlib.Path
    files: dict[str, int]
    seconds: float

    def __str__(self) -> str:
        lines = [f"compiled {len(self.files)} modules in {self.seconds:.1f} s:"]
        for name, size in sorted(self.files.items()):
            lines.append(f"  {name:<52} {size / 1024:>8.1f} KiB")
        return "\n".join(lines)


def compile_artifact(
    directory: str | os.PathLike[str],
    targets: Sequence[str] = ("llvm-cpu",),
    *,
    cpu: str = "host",
    cuda_arch: str = "sm_80",
    jobs: int | None = None,
    cache: str | os.PathLike[str] | None = None,
    functions: Sequence[str] | None = None,
) -> CompileSummary:
    """Compile every static module of the artifact at `directory` for each of `targets` (any of
    `TARGETS`), `jobs` at a time (default: one per CPU). Compiling again replaces the modules of
    the targets asked for and keeps the others.

    `functions`: only the static modules of these exported functions (default all): what a
    deployment runs, such as a language model's decoding (`init_cache`, `sample_prefill`,
    `sample_step`), in less than half the time of all seven.

    `cache`: a directory of compiled modules to reuse (default: `$DENSE_ARMOR_IREE_CACHE`, if
    set; else none). An entry is keyed by the module's bytes, the target's flags, the compiler's
    version and, for `cpu="host"`, this machine's CPU, so a hit is what the compiler wrote for
    the same input (its bytes vary from one run to the next, its code does not); entries are
    written whole (renamed into place), checked against the sha256 in their name when read (a
    corrupted one is compiled again), and may be deleted at any time."""
    started = time.perf_counter()
    target = pathlib.Path(directory)
    if isinstance(targets, str) or not targets:
        raise ArtifactError(f"targets must be a non-empty list of {TARGETS}; got {targets!r}.")
    flags = {t: target_flags(t, cpu, cuda_arch) for t in targets}
    manifest = read_manifest(target)
    require_one_device(manifest, "IREE (compile)")
    verify_files(target, manifest)
    tools = _compiler()
    modules = _static_modules(target, manifest, functions)
    if jobs is not None:
        require_int(1, caller="compile_artifact (or None)", error=ArtifactError, jobs=jobs)
    work = _Work(tools, manifest, modules, flags, int(jobs or os.cpu_count() or 1))
    store = _compile_cache(cache)
    atomic.write_directory(target, lambda tmp: _fill(target, tmp, work, store))
    written = read_manifest(target)["compiled"]
    files = {
        c["file"]: (target / c["file"]).stat().st_size for c in written if c["target"] in flags
    }
    return CompileSummary(target, files, time.perf_counter() - started)


class _Work(NamedTuple):
    """What `compile_artifact` compiles: with the compiler `tools`, the `modules` of the
    artifact (its `manifest`'s) for each target of `flags` (its flags), `jobs` at a time."""

    tools: Any
    manifest: dict[str, Any]
    modules: list[str]
    flags: dict[str, list[str]]
    jobs: int


def _static_modules(
    target: pathlib.Path, manifest: dict[str, Any], functions: Sequence[str] | None
) -> list[str]:
    """The static modules of the chosen `functions` (all: None), or an `ArtifactError`."""
    chosen = _chosen_functions(manifest, functions)
    modules = sorted({e["bytecode"] for e in manifest["static"] if e["function"] in chosen})
    if not modules:
        raise ArtifactError(
            f"{target} has no static modules to compile: export it with static shapes "
            "(`static_shapes=[(B, T)]`, `--static B,T`)."
        )
    return modules


def _fill(target: pathlib.Path, tmp: pathlib.Path, work: _Work, store: Any) -> None:
    """`tmp`: the artifact at `target` with `work`'s modules compiled (replacing those of its
    targets, keeping the others) and its manifest listing them."""
    manifest, flags = work.manifest, work.flags
    shutil.copytree(target, tmp, dirs_exist_ok=True)
    kept = [c for c in manifest.get("compiled", []) if c["target"] not in flags]
    for old in manifest.get("compiled", []):
        if old["target"] in flags:
            (tmp / old["file"]).unlink(missing_ok=True)
    items = [(module, t) for module in work.modules for t in flags]

    def one(item: tuple[str, str]) -> dict[str, Any]:
        return _compile_module(work.tools, tmp, item[0], item[1], flags[item[1]], store)

    with concurrent.futures.ThreadPoolExecutor(work.jobs) as pool:
        compiled = list(pool.map(one, items))
    version = _compiler_version()
    new = {**manifest, "compiled": kept + [{**c, "iree": version} for c in compiled]}
    new.pop("files")
    new["files"] = file_table(tmp)
    (tmp / MANIFEST).write_text(json.dumps(new, indent=2) + "\n")


def _chosen_functions(manifest: dict[str, Any], functions: Sequence[str] | None) -> set[str]:
    """The exported functions to compile: `functions`, each one the artifact's, or all."""
    known = sorted(manifest["functions"])
    if functions is None:
        return set(known)
    if isinstance(functions, str) or not isinstance(functions, Sequence) or not functions:
        raise ArtifactError(
            f"`functions` must be a non-empty list of the artifact's functions {known}; "
            f"received {functions!r}."
        )
    unknown = [f for f in functions if f not in known]
    if unknown:
        raise ArtifactError(f"the artifact has no function {unknown}; its functions: {known}.")
    return set(functions)


def _compile_cache(cache: str | os.PathLike[str] | None) -> pathlib.Path | None:
    """The directory of compiled modules to reuse: `cache`, else `$DENSE_ARMOR_IREE_CACHE`."""
    cache = os.environ.get("DENSE_ARMOR_IREE_CACHE") if cache is None else cache
    store = pathlib.Path(cache) if cache else None
    if store is not None and store.is_file():
        raise ArtifactError(f"the compile cache {store} is a file, not a directory.")
    return store


def _compile_module(
    tools: Any,
    tmp: pathlib.Path,
    module: str,
    target: str,
    flags: list[str],
    store: pathlib.Path | None,
) -> dict[str, Any]:
    """Compile one static module of the artifact being written at `tmp` for `target` (or take
    it from the cache `store`): its entry in the manifest's `compiled` list."""
    out = module.removesuffix(".mlirbc") + f".{target}.vmfb"
    key = None if store is None else _cache_key(tmp / module, flags)
    if store is None or key is None or not _cached(store, key, tmp / out):
        try:
            tools.compile_file(str(tmp / module), output_file=str(tmp / out), extra_args=flags)
        except tools.CompilerToolError as error:
            raise ArtifactError(f"iree-compile failed on {module} for {target}: {error}") from None
        if store is not None and key is not None:
            _store(tmp / out, store, key)
    return {"module": module, "target": target, "file": out, "flags": flags}


def _cpuinfo() -> str:
    """This machine's /proc/cpuinfo, or nothing where there is none."""
    try:
        return pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _host_cpu() -> str:
    """What an `llvm-cpu` module tuned for `host` depends on: the CPU's model and features."""
    lines = _cpuinfo().splitlines()
    if not lines:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def _cache_key(module: pathlib.Path, flags: list[str]) -> str:
    digest = hashlib.sha256(module.read_bytes())
    digest.update("\0".join([*flags, _compiler_version()]).encode())
    if any(flag.endswith("-target-cpu=host") for flag in flags):
        digest.update(_host_cpu().encode())
    return digest.hexdigest()


def _cached(store: pathlib.Path, key: str, out: pathlib.Path) -> bool:
    """Copy the cache's entry for `key` to `out`, if it has one whose bytes match the sha256 in
    its name (`<key>.<sha256>.vmfb`); a truncated or edited entry is no entry: it is compiled
    again and replaced."""
    for entry in store.glob(f"{key}.*.vmfb"):
        data = entry.read_bytes()
        if hashlib.sha256(data).hexdigest() == entry.name.split(".")[1]:
            out.write_bytes(data)
            return True
        entry.unlink(missing_ok=True)
    return False


def _store(compiled: pathlib.Path, store: pathlib.Path, key: str) -> None:
    """Put a compiled module into the cache whole, named by its key and its own sha256: written
    beside, then renamed into place."""
    try:
        store.mkdir(parents=True, exist_ok=True)
        data = compiled.read_bytes()
        entry = store / f"{key}.{hashlib.sha256(data).hexdigest()}.vmfb"
        partial = store / f".{entry.name}.{os.getpid()}.{threading.get_ident()}"
        partial.write_bytes(data)
        os.replace(partial, entry)
    except OSError:  # a cache that cannot be written is no cache, not a failed compile
        pass


@functools.cache
def _compiler_version() -> str:
    try:
        from importlib.metadata import version

        return version("iree-base-compiler")
    except Exception:  # a source build has no distribution metadata
        return "unknown"
