"""Strict numerics for every test: silent broadcasting or dtype promotion is a bug here. One JAX
compilation cache shared by every process of the suite (tests/environment.py). And the files run
longest first."""

import jax
import pytest

from environment import enable_compilation_cache, trim_compilation_cache

jax.config.update("jax_numpy_rank_promotion", "raise")
enable_compilation_cache()


# The files that take longest (seconds of test time on a 2-core machine, 2026-12-02: docs 74,
# prefill 70, export 65, examples 50, ...), run first: the workers (`--dist=loadfile`, a file
# to a worker) take files in collection order, so a long file taken last keeps one worker busy
# while the other has finished. The rest follow in their usual order.
LONGEST_FIRST = [
    "test_docs.py",
    "test_prefill.py",
    "test_export.py",
    "test_examples.py",
    "test_recurrent.py",
    "test_distributed.py",
    "test_sequences.py",
    "test_iree.py",
    "test_scan.py",
    "test_sharded_checkpoint.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within


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
