"""Streaming caches: what `init_cache` returns and `step` threads through.

Two kinds of key/value cache serve the attention layers:

- `KVCache`, the growing cache of the attention page: two arrays of shape `(t, d_model)` that gain
  one row per step. Exact and simple; under `jax.jit` it recompiles at every length.
- `FixedKVCache`, preallocated buffers of shape `(n_heads, capacity, d_head)` plus a counter. Its
  shapes never change, so a jitted or exported step compiles once (donate the cache to update it in
  place), and each head's keys lie contiguous, so a step needs no transpose.
- `RingKVCache`, for a sliding-window layer: the last `window` steps in a ring that never fills.

Layers with other time state carry it in `PositionCache` (the step index) and `MeanCache` (a running
sum and count). Every cache is a PyTree of arrays.

A fixed cache that is full never overwrites a row. What happens instead is the cache's
`on_overflow` mode, chosen at `init_cache`:

- `"raise"` (default): the step raises `equinox.EquinoxRuntimeError`, eagerly and under
  `eqx.filter_jit`. Under plain `jax.jit`, XLA reports the same message inside a `ValueError`
  (`jax.errors.JaxRuntimeError`, "INTERNAL: CpuCallback error ...") after a callback traceback:
  jit a stepping loop with `eqx.filter_jit` for the clean error, or use `"nan"` and read the flag;
- `"nan"`: the step's output is NaN and the cache's `overflow` flag becomes (and stays) `True`.
  This mode uses no host callback, so it is the one an exported step uses.
"""

from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .core import python_scalar

__all__ = [
    "OVERFLOW_MODES",
    "FixedKVCache",
    "KVCache",
    "MeanCache",
    "PositionCache",
    "RingKVCache",
    "guard_overflow",
    "validate_overflow_mode",
]

OVERFLOW_MODES = ("raise", "nan")


def validate_overflow_mode(on_overflow: str) -> None:
    if on_overflow not in OVERFLOW_MODES:
        raise ValueError(
            f"`on_overflow` must be one of {OVERFLOW_MODES}; "
            f"received `on_overflow={on_overflow!r}`."
        )


def guard_overflow(y: Array, bad: Bool[Array, ""], on_overflow: str, message: str) -> Array:
    """Return `y`, or fail as `on_overflow` says when `bad` is true."""
    if on_overflow == "raise":
        return eqx.error_if(y, bad, message)
    return jnp.where(bad, jnp.asarray(jnp.nan, y.dtype), y)


class KVCache(NamedTuple):
    """The growing cache: keys and values of the steps seen so far, shape `(t, d_model)` each."""

    keys: Float[Array, "t d_model"]
    values: Float[Array, "t d_model"]


class FixedKVCache(eqx.Module):
    """Preallocated keys and values, per head: `(n_heads, capacity, d_head)`; rows `>= index` are
    unwritten."""

    keys: Float[Array, "n_heads capacity d_head"]
    values: Float[Array, "n_heads capacity d_head"]
    index: Int[Array, ""]
    overflow: Bool[Array, ""]
    on_overflow: str = eqx.field(static=True, converter=python_scalar, default="raise")

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]


class RingKVCache(eqx.Module):
    """The cache of a sliding-window layer: the keys and values of the last `window` steps, in a
    ring of `window` rows per head, `(n_heads, window, d_head)`. It never fills up, so a stream can
    go on forever in constant memory.

    `index` counts the steps seen, folded into `[0, 2 * window)` once past `window` so it never
    overflows: the next row to write is `index % window`, and rows `< min(index, window)` hold
    steps.
    """

    keys: Float[Array, "n_heads window d_head"]
    values: Float[Array, "n_heads window d_head"]
    index: Int[Array, ""]

    @property
    def window(self) -> int:
        return self.keys.shape[1]


class PositionCache(eqx.Module):
    """The index of the next step, for the positional encodings."""

    index: Int[Array, ""]
    overflow: Bool[Array, ""]
    on_overflow: str = eqx.field(static=True, converter=python_scalar, default="raise")


class MeanCache(eqx.Module):
    """The running sum and count of the steps seen so far, for `MeanOverTime`."""

    total: Float[Array, " features"]
    count: Int[Array, ""]


def start_index() -> tuple[Int[Array, ""], Bool[Array, ""]]:
    """A zero step counter and a clear overflow flag."""
    return jnp.zeros((), jnp.int32), jnp.zeros((), bool)
