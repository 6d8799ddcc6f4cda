"""The suite's JAX compilation cache, the one MLIR context its lowerings share, and the
environment of the processes the suite starts.

Every process of the suite (the pytest workers, and the interpreters started for documentation
pages, examples and distributed runs) shares one persistent JAX compilation cache, so a function
compiled once (an eager primitive at a shape, a model's step) is read back from disk by the next
process instead of compiled again, in this run and in the next one, like the virtual environment
nox keeps. The cache changes no result: its key is the computation, the compile options and the
jax/jaxlib versions. It lives in the user's cache directory (`$XDG_CACHE_HOME`, default
`~/.cache`, then `dense_armor/jax-tests`), or where `DENSE_ARMOR_TEST_JAX_CACHE` says; delete it
at will. IREE's compiled modules have a cache of their own beside it (`-iree`), read and written by
`compile_artifact` through `DENSE_ARMOR_IREE_CACHE`, and the C runner's compiled executables one
too (`-pjrt`, `DENSE_ARMOR_PJRT_CACHE`). A session that finds any of them over 1 GiB empties
it first (JAX's own size cap takes a file lock
on every access, which slowed the suite by a third).
"""

import gc
import os
import pathlib
import shutil
import subprocess
import sys
import threading

USER_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
CACHE_DIR = pathlib.Path(
    os.environ.get("DENSE_ARMOR_TEST_JAX_CACHE") or USER_CACHE / "dense_armor" / "jax-tests"
)
# IREE's compiled modules, likewise (`compile_artifact`'s cache, keyed by module, flags, compiler
# version and CPU): beside JAX's.
IREE_CACHE_DIR = CACHE_DIR.with_name(CACHE_DIR.name + "-iree")
# The C runner's executables as the PJRT plugin serializes them (`runner.c`'s cache, keyed by
# module, compile options, XLA_FLAGS and plugin): beside them too.
PJRT_CACHE_DIR = CACHE_DIR.with_name(CACHE_DIR.name + "-pjrt")
CACHE_SETTINGS = {
    "JAX_COMPILATION_CACHE_DIR": str(CACHE_DIR),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    "DENSE_ARMOR_IREE_CACHE": str(IREE_CACHE_DIR),
    "DENSE_ARMOR_PJRT_CACHE": str(PJRT_CACHE_DIR),
}
MAX_BYTES = 2**30

# The suite's own compilations at XLA's lowest LLVM optimisation level and with its older
# elemental fusion emitters: on an empty compilation cache most of a test's time is XLA
# compiling small functions (17,600 of them, an eager op at a shape among them), and level 0
# compiles them in 0.55x the time of the default, the older emitters in 0.6x of that (an eager
# op 14 -> 6.7 ms, measured on the 2-core Xeon, jax 0.10.2), and each module's machine code in
# one piece instead of split for threads to compile in parallel (the CPU time of compiling three
# functions of each of three imported models 5.0 -> 3.8 s: with two busy workers on two cores
# the split's threads only add work). No fast-math either way, so the
# numerics are IEEE's. The pytest workers and the suite's own children take them (`child_env`;
# the C runner's PJRT plugin reads XLA_FLAGS too); the pages and examples run in children with
# JAX's defaults, as a reader runs them, and the benchmarks in a process of their own.
SUITE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)


def compile_quickly() -> None:
    """This process's XLA_FLAGS gain `SUITE_XLA_FLAGS` (before its first compilation)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if SUITE_XLA_FLAGS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SUITE_XLA_FLAGS}".strip()


def trim_compilation_cache() -> None:
    """Empty a cache that has grown past `MAX_BYTES` (entries of code long changed)."""
    for directory in (CACHE_DIR, IREE_CACHE_DIR, PJRT_CACHE_DIR):
        if not directory.is_dir():
            continue
        entries = list(os.scandir(directory))
        if sum(e.stat().st_size for e in entries if e.is_file()) > MAX_BYTES:
            shutil.rmtree(directory, ignore_errors=True)


def enable_compilation_cache() -> None:
    """Turn the shared caches on in this process (before its first compilation)."""
    import jax

    for name, value in CACHE_SETTINGS.items():
        if not name.startswith("JAX_"):
            os.environ[name] = value
            continue
        option = name.lower()
        jax.config.update(option, value if option.endswith("dir") else int(value))


def child_env(*, as_users_run: bool = False, **extra: str) -> dict[str, str]:
    """This environment without any JAX_ or XLA_ setting of the caller, with the shared cache,
    and with `extra`. A child of the suite's own (a worker, a killed writer) compiles as the
    suite does (`SUITE_XLA_FLAGS`, before any XLA_FLAGS of `extra`), so its results are the
    test's bit for bit; a page or an example (`as_users_run=True`) starts with JAX's defaults, as
    a reader's interpreter would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    if not as_users_run:
        extra["XLA_FLAGS"] = f"{SUITE_XLA_FLAGS} {extra.get('XLA_FLAGS', '')}".strip()
    return {**env, **CACHE_SETTINGS, **extra}


_CONTEXTS = threading.local()


def share_one_mlir_context() -> None:
    """Each thread of this process lowers every function into one MLIR context, instead of a
    new context per lowering (JAX's `make_ir_context`, which loads every dialect again: 4 ms
    apiece). Every module JAX keeps (a compiled function's, in its caches) holds the context it
    was made in, so a worker held thousands of them: test_attention, test_blocked and test_gqa
    in one process (warm caches) took 64-75 s and 2.26 GB at its peak, and 41-43 s and 0.61-0.65
    GB with one context (the garbage collector's thresholds made no difference: 67 s, 2.26 GB).
    What is lowered is the same: a tiny Qwen3.5's artifact, every module and golden file, is the
    same bytes either way. `fresh_mlir_context` starts a new one (after each file, with JAX's
    caches). Where JAX has no `make_ir_context` (another version), nothing changes."""
    from jax._src.interpreters import mlir

    made = getattr(mlir, "make_ir_context", None)
    if made is None or getattr(made, "shared", False):
        return

    def shared_context():
        context = getattr(_CONTEXTS, "context", None)
        if context is None:
            context = _CONTEXTS.context = made()
        return context

    shared_context.shared = True  # type: ignore[attr-defined]
    mlir.make_ir_context = shared_context


def fresh_mlir_context() -> None:
    """The next lowering in this thread starts a new shared context (`share_one_mlir_context`);
    the old one is freed with the last module that holds it."""
    _CONTEXTS.context = None


def collect_garbage_less_often() -> None:
    """Python's cyclic garbage collector, run less often in this process: JAX's tracing and
    lowering allocate millions of short-lived objects, and at the default thresholds (a young
    collection every 700 allocations, a full one every 100 of those) the full passes walk the
    large heap of JAX's caches again and again. Objects alive now (the imported modules) are
    moved out of the collector's sight (`gc.freeze`). Measured: test_prefill.py and
    test_scan.py 55 s -> 49 s. Reference cycles are still collected, later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def run_py_without(
    directory: pathlib.Path, blocked: tuple[str, ...], *arguments: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The artifact's own `run.py DIRECTORY ARGUMENTS...` in a fresh interpreter in which the
    top-level packages `blocked` cannot be imported (what a deployment without them sees)."""
    blocker = (
        "import sys, runpy\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError(name + ' is not available here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['run.py', *sys.argv[1:]]\n"
        "runpy.run_path(sys.argv[1] + '/run.py', run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", blocker, str(directory), *arguments],
        capture_output=True,
        text=True,
        env=env,
    )
