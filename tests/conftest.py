"""Strict numerics for every test: silent broadcasting or dtype promotion is a bug here. And one
JAX compilation cache shared by every process of the suite, XLA's quickest compilation for the
suite's own functions, one MLIR context per thread for JAX's lowerings, and a garbage collector
that runs less often (tests/environment.py)."""

import gc
import os

from environment import (
    collect_garbage_less_often,
    compile_quickly,
    enable_compilation_cache,
    fresh_mlir_context,
    share_one_mlir_context,
    trim_compilation_cache,
)

compile_quickly()  # before jax starts its backend

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
enable_compilation_cache()
share_one_mlir_context()


# The test files that take longest, longest first (seconds of one worker with empty compilation
# caches, measured on the 2-core AMD EPYC with tests/profile_suite.py, 2026-12-06): the suite's
# workers take whole files (`--dist=loadfile`) in collection order (with
# `--no-loadscope-reorder`, as the noxfile runs it; xdist otherwise sorts files by their number
# of tests), so when the longest go first the last files to run are short ones and neither worker
# waits on the other at the end.
LONGEST_FIRST = [  # worker-seconds of each file with empty caches (2026-12-06, evening)
    "test_architecture_artifacts.py",  # 467 (20 exports, each in JAX, IREE and C)
    "test_docs.py",  # 385
    "test_hf_architectures.py",  # 207
    "test_examples.py",  # 141
    "test_index_safety.py",  # 127
    "test_language_models.py",  # 125
    "test_paged.py",  # 108
    "test_iree.py",  # 102
    "test_export.py",  # 92
    "test_precision.py",  # 71
    "test_bad_inputs.py",  # 66
    "test_sequences.py",  # 57
    "test_serving.py",  # 52
    "test_prefill.py",  # 51
    "test_distributed.py",  # 51
    "test_runner.py",  # 48
    "test_recurrent.py",  # 41
    "test_http.py",  # 39
    "test_attention.py",  # 39
    "test_scan.py",  # 35
    "test_sharded_checkpoint.py",  # 33
    "test_blocked.py",  # 32
    "test_training.py",  # 26
    "test_gqa.py",  # 26
    "test_streaming.py",  # 23
    "test_rotary.py",  # 21
]


def pytest_collection_modifyitems(session, config, items):
    """The longest files first; the others after them, as collected; each file's own order
    kept (the sort is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _fresh_heap_per_file():
    """After each file, JAX's in-memory caches emptied, a new MLIR context for the next file's
    lowerings and the garbage collected: a worker runs dozens of files, and what one file
    compiled (read back from the disk cache by the next file that needs it) made every later
    file's tracing slower as the heap grew (the suite's last files ran up to twice as slow as
    the same files run first)."""
    yield
    jax.clear_caches()
    fresh_mlir_context()
    gc.collect()


def pytest_configure(config):
    """`DENSE_ARMOR_TEST_PROFILE=DIRECTORY`: each worker's seconds per file and, of them, JAX's
    tracing, lowering and compiling (tests/profile_suite.py)."""
    directory = os.environ.get("DENSE_ARMOR_TEST_PROFILE")
    if directory:
        from profile_suite import Profile

        config.pluginmanager.register(Profile(directory), "dense_armor_profile")


def pytest_collection_finish(session):
    collect_garbage_less_often()  # the test modules imported: out of the collector's sight


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # once, in the controlling process
        trim_compilation_cache()


class KeyStream:
    """A fresh PRNG key at every call, from a fixed seed."""

    def __init__(self, seed: int = 0):
        self._key = jax.random.PRNGKey(seed)

    def __call__(self) -> jax.Array:
        self._key, sub = jax.random.split(self._key)
        return sub


@pytest.fixture
def getkey() -> KeyStream:
    return KeyStream()


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    """Strict promotion, except in tests marked `optax`: optax's own updates mix int and float."""
    mode = "standard" if request.node.get_closest_marker("optax") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield
