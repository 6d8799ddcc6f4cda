"""Strict numerics for every test: silent broadcasting or dtype promotion is a bug here. And one
JAX compilation cache shared by every process of the suite, and a garbage collector that runs
less often (tests/environment.py)."""

import jax
import pytest

from environment import collect_garbage_less_often, enable_compilation_cache, trim_compilation_cache

jax.config.update("jax_numpy_rank_promotion", "raise")
enable_compilation_cache()


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
