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

The protocol (`KeyValueCache`, abstract): a key/value cache owns its update. `cache.update(keys,
values, window, owner)` takes the new steps' keys and values per head, `(n_heads, K, d_head)` for
`K` steps, and returns a `KVUpdate`: what the attention reads (keys, values, and which of them each
new step may see) and the updated cache; `cache.guard(y, fits)` then applies the cache's overflow
rule to the `K` output rows. The growing, fixed and ring caches all answer it, so a layer's `step`
and `prefill` have one code path; a new kind of cache is one new class. One `Counter` (index,
overflow flag, overflow mode, limit) serves the fixed cache and the positions.

A batch of streams is a cache with a leading batch axis on every array (`batch_streams`, or
`init_cache` under `jax.vmap`); every stream keeps its own counters. Every fixed-shape cache's empty
state is all zeros (counters at 0, flags false), so `reset(cache, streams)` returns the chosen
streams to it and leaves the others untouched.

A fixed cache that is full never overwrites a row. What happens instead is the cache's
`on_overflow` mode, chosen at `init_cache`:

- `"raise"` (default): the step raises `equinox.EquinoxRuntimeError`, eagerly and under
  `eqx.filter_jit`. Under plain `jax.jit`, XLA wraps the same message in a `ValueError`
  (`jax.errors.JaxRuntimeError`, "INTERNAL: CpuCallback error ..."); the line JAX logs before
  that traceback is the message itself ("dense_armor: the key/value cache is full ...", see
  `counter._OverflowFirst`). Jit a stepping loop with `eqx.filter_jit` for the clean exception,
  or use `"nan"` and read the flag;
- `"nan"`: the step's output is NaN and the cache's `overflow` flag becomes (and stays) `True`.
  This mode uses no host callback, so it is the one an exported step uses.

A `Stream` (`nn.models.stream`) keeps the raise without the callback: its cache is in `"nan"` mode
and it refuses, on the host, a step past the counters' smallest `limit` (static, so known without
reading the device).
"""

import abc
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core import ShapeError, sees
from .counter import Counter
from .rows import (
    _check_buffers,
    _heads,
    _quantized,
    _refuse_window,
    _scales,
    _write_rows,
    _zero_scales,
)

__all__ = [
    "FixedKVCache",
    "KVCache",
    "KeyValueCache",
    "KVUpdate",
    "MeanCache",
    "PositionCache",
    "RingKVCache",
]


class KVUpdate(NamedTuple):
    """What a key/value cache's `update` returns: the keys and values the new steps attend over,
    `(n_heads, L, d_head)`, which of the `L` each new step may see, `visible (K, L)`, which new
    steps the cache could hold, `fits (K,)`, the updated cache, and the positions of the new
    steps `(K,)` and of the `L` keys `(L,)` (for rotary positions: only their differences
    matter, so a ring counts them in its own folded frame)."""

    keys: Array
    values: Array
    visible: Array
    fits: Array
    cache: Any
    query_positions: Array
    key_positions: Array
    # True when every key a new step may not see is an unwritten row, all zeros (a single step
    # of a growing or fixed cache): no hidden value can be non-finite, so the attention skips
    # the pass that zeroes them (a Python bool, known at trace time).
    hidden_zeros: bool = False
    # An int8 cache's scales `(n_heads, L)`: key `l` is `keys[:, l] * key_scales[:, l]` (applied
    # to the scores), value `l` likewise (applied to the attention weights); None for a float one.
    key_scales: Array | None = None
    value_scales: Array | None = None
    # A paged cache's `(keys pool, values pool, table, window, read)` after the write, for a
    # kernel that reads the pages in place (`kernels.paged`) instead of `keys` and `values`.
    pages: tuple[Array, Array, Array, int | None, str] | None = None


class KeyValueCache(eqx.Module):
    """The protocol every key/value cache answers (abstract; each cache class is final).

    `update(keys, values, window, owner)` takes the new steps' keys and values per head,
    `(n_heads, K, d_head)` for `K` steps, and returns a `KVUpdate`: what the attention reads and
    the updated cache. `window` is the layer's (a ring cache needs one, the others refuse one);
    `owner` names the method that called, for the errors. `guard(y, fits)` applies the cache's
    overflow rule to the `K` output rows. `fixed_shape` says whether the cache's shapes stay the
    same from step to step (what a jitted or exported step needs)."""

    fixed_shape: eqx.AbstractClassVar[bool]

    @abc.abstractmethod
    def update(self, keys: Array, values: Array, window: int | None, owner: str) -> KVUpdate:
        """The new steps written; what they attend over."""

    @abc.abstractmethod
    def guard(self, y: Array, fits: Array) -> Array:
        """`y (K, ...)` under the overflow rule, `fits (K,)` saying which steps the cache held."""


class KVCache(KeyValueCache):
    """The growing cache: keys and values of the steps seen so far, shape `(t, d_model)` each (two
    arrays: `keys, values = cache`)."""

    keys: Float[Array, "t d_model"]
    values: Float[Array, "t d_model"]

    fixed_shape: ClassVar[bool] = False

    def __iter__(self) -> Iterator[Array]:
        return iter((self.keys, self.values))

    def in_dtype(self, dtype: Any) -> "KVCache":
        """This cache with its buffers stored in float `dtype`."""
        return KVCache(self.keys.astype(dtype), self.values.astype(dtype))

    def update(self, keys: Array, values: Array, window: int | None, owner: str) -> KVUpdate:
        _refuse_window(window, owner)
        n_heads, steps, d_head = keys.shape
        if self.keys.ndim != 2 or self.keys.shape[1] != n_heads * d_head:
            raise ShapeError(
                f"{owner}: received `cache.keys.shape={self.keys.shape}`; "
                f"expected `(t, {n_heads * d_head})` (key/value heads x d_head). Use "
                "`init_cache()`."
            )

        def grown(old: Array, new: Array) -> Array:
            rows = new.transpose(1, 0, 2).reshape(steps, n_heads * d_head)
            return jnp.concatenate([old, rows.astype(old.dtype)])

        all_keys, all_values = grown(self.keys, keys), grown(self.values, values)
        seen = self.keys.shape[0]
        visible = sees(seen + jnp.arange(steps)[:, None], jnp.arange(seen + steps)[None, :])
        return KVUpdate(
            _heads(all_keys, n_heads),
            _heads(all_values, n_heads),
            visible,
            jnp.ones(steps, bool),
            KVCache(all_keys, all_values),
            seen + jnp.arange(steps),
            jnp.arange(seen + steps),
            hidden_zeros=steps == 1,  # one step sees every key
        )

    def guard(self, y: Array, fits: Array) -> Array:
        return y


class Counted(eqx.Module):
    """A cache with a `Counter`: its `index`, `overflow` flag and `on_overflow` mode, read
    through."""

    counter: eqx.AbstractVar[Counter]

    @property
    def index(self) -> Array:
        return self.counter.index

    @property
    def overflow(self) -> Array:
        return self.counter.overflow

    @property
    def on_overflow(self) -> str:
        return self.counter.on_overflow


class FixedKVCache(KeyValueCache, Counted):
    """Preallocated keys and values, per head: `(n_heads, capacity, d_head)`; rows `>= index` are
    unwritten. Its `counter` holds the index, the overflow flag and the overflow mode. An int8
    cache (`quantized()`) holds int8 rows and their float32 scales, `(n_heads, capacity, 1)`."""

    keys: Float[Array, "n_heads capacity d_head"] | Int[Array, "n_heads capacity d_head"]
    values: Float[Array, "n_heads capacity d_head"] | Int[Array, "n_heads capacity d_head"]
    counter: Counter
    key_scale: Float[Array, "n_heads capacity 1"] | None = None
    value_scale: Float[Array, "n_heads capacity 1"] | None = None

    fixed_shape: ClassVar[bool] = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def in_dtype(self, dtype: Any) -> "FixedKVCache":
        """This (float) cache with its buffers stored in float `dtype`."""
        keys, values = self.keys.astype(dtype), self.values.astype(dtype)
        return FixedKVCache(keys=keys, values=values, counter=self.counter)

    def quantized(self) -> "FixedKVCache":
        """This (fresh) cache as int8 rows with zero scales: every row unwritten."""
        int8 = jnp.zeros(self.keys.shape, jnp.int8)
        scales = _zero_scales(self.keys)
        return FixedKVCache(
            keys=int8,
            values=int8,
            counter=self.counter,
            key_scale=scales,
            value_scale=jnp.zeros_like(scales),
        )

    def update(self, keys: Array, values: Array, window: int | None, owner: str) -> KVUpdate:
        _refuse_window(window, owner)
        _check_buffers(self.keys, keys, "capacity", owner)
        positions, fits, counter = self.counter.advance(keys.shape[1])
        # A step past the last slot writes slot N - 1 again, with what that slot ends up holding:
        # the chunk's row for it, or (the cache full before the chunk) the row already there.
        slots = jnp.minimum(positions, self.capacity - 1)
        first = self.counter.index
        keep = slots < first
        key_scale = value_scale = None
        if self.key_scale is not None and self.value_scale is not None:  # an int8 cache
            keys, values, new_key_scale, new_value_scale = _quantized(keys, values)
            key_scale = _write_rows(self.key_scale, new_key_scale, slots, slots - first, keep)
            value_scale = _write_rows(self.value_scale, new_value_scale, slots, slots - first, keep)
        new_keys = _write_rows(self.keys, keys, slots, slots - first, keep)
        new_values = _write_rows(self.values, values, slots, slots - first, keep)
        visible = sees(
            positions[:, None], jnp.arange(self.capacity, dtype=positions.dtype)[None, :]
        )
        cache = FixedKVCache(
            keys=new_keys,
            values=new_values,
            counter=counter,
            key_scale=key_scale,
            value_scale=value_scale,
        )
        return KVUpdate(
            new_keys,
            new_values,
            visible,
            fits,
            cache,
            positions,
            jnp.arange(self.capacity, dtype=positions.dtype),
            # one step sees every written row; the rows it may not see are unwritten zeros
            hidden_zeros=keys.shape[1] == 1,
            key_scales=_scales(key_scale),
            value_scales=_scales(value_scale),
        )

    def guard(self, y: Array, fits: Array) -> Array:
        return self.counter.guard(
            y, fits, f"the key/value cache is full (capacity {self.capacity})"
        )


class RingKVCache(KeyValueCache):
    """The cache of a sliding-window layer: the keys and values of the last `window` steps, in a
    ring of `window` rows per head, `(n_heads, window, d_head)`. It never fills up, so a stream can
    go on forever in constant memory.

    `index` counts the steps seen, folded into `[0, 2 * window)` once past `window` so it never
    overflows: the next row to write is `index % window`, and rows `< min(index, window)` hold
    steps.
    """

    keys: Float[Array, "n_heads window d_head"] | Int[Array, "n_heads window d_head"]
    values: Float[Array, "n_heads window d_head"] | Int[Array, "n_heads window d_head"]
    index: Int[Array, ""]
    key_scale: Float[Array, "n_heads window 1"] | None = None
    value_scale: Float[Array, "n_heads window 1"] | None = None

    fixed_shape: ClassVar[bool] = True

    @property
    def window(self) -> int:
        return self.keys.shape[1]

    def in_dtype(self, dtype: Any) -> "RingKVCache":
        """This (float) cache with its buffers stored in float `dtype`."""
        return RingKVCache(self.keys.astype(dtype), self.values.astype(dtype), self.index)

    def quantized(self) -> "RingKVCache":
        """This (fresh) ring as int8 rows with zero scales (see `FixedKVCache.quantized`)."""
        int8 = jnp.zeros(self.keys.shape, jnp.int8)
        scales = _zero_scales(self.keys)
        return RingKVCache(int8, int8, self.index, scales, jnp.zeros_like(scales))

    def update(self, keys: Array, values: Array, window: int | None, owner: str) -> KVUpdate:
        if window is None:
            raise ValueError(
                f"{owner}: a windowed layer steps with the ring cache of its own `init_cache()`, "
                "and only a windowed layer does."
            )
        _check_buffers(self.keys, keys, f"window={window}", owner)
        if self.window != window:
            raise ShapeError(
                f"{owner}: the ring cache holds {self.window} steps; this "
                f"layer's window is {window}. Use this layer's `init_cache()`."
            )
        steps, n = keys.shape[1], self.index
        # The position each ring row holds (negative: not written yet), and the new steps'.
        rows = jnp.arange(window, dtype=n.dtype)
        held = n - 1 - jnp.mod(n - 1 - rows, window)
        new = n + jnp.arange(steps, dtype=n.dtype)
        positions = jnp.concatenate([held, new])
        written = jnp.concatenate([held >= 0, jnp.ones(steps, bool)])
        visible = written[None, :] & sees(new[:, None], positions[None, :], window)
        # The softmax does not care about the order of the keys, so the ring needs no rotation.
        # Only the last `window` new steps stay in the ring, each in its own row: an earlier one
        # of a long chunk writes its slot with the later step that the slot keeps (arithmetic on
        # `arange`, so `steps` may be symbolic).
        i = jnp.arange(steps, dtype=n.dtype)
        last = i + window * ((steps - 1 - i) // window)
        slots = jnp.mod(new, window)
        key_scale = value_scale = seen_key_scales = seen_value_scales = None
        if self.key_scale is not None and self.value_scale is not None:
            keys, values, new_key_scale, new_value_scale = _quantized(keys, values)
            key_scale = _write_rows(self.key_scale, new_key_scale, slots, last)
            value_scale = _write_rows(self.value_scale, new_value_scale, slots, last)
            seen_key_scales = jnp.concatenate([self.key_scale, new_key_scale], axis=1)[..., 0]
            seen_value_scales = jnp.concatenate([self.value_scale, new_value_scale], 1)[..., 0]
        ring_keys = _write_rows(self.keys, keys, slots, last)
        ring_values = _write_rows(self.values, values, slots, last)
        index = n + steps
        index = jnp.where(index >= 2 * window, window + jnp.mod(index - window, window), index)
        ring = RingKVCache(ring_keys, ring_values, index.astype(n.dtype), key_scale, value_scale)
        return KVUpdate(
            jnp.concatenate([self.keys, keys.astype(self.keys.dtype)], axis=1),
            jnp.concatenate([self.values, values.astype(self.values.dtype)], axis=1),
            visible,
            jnp.ones(steps, bool),
            ring,
            new,
            positions,
            key_scales=seen_key_scales,
            value_scales=seen_value_scales,
        )

    def guard(self, y: Array, fits: Array) -> Array:
        return y


class PositionCache(Counted):
    """The index of the next step, for the positional encodings, in a `Counter`."""

    counter: Counter


class MeanCache(eqx.Module):
    """The running sum and count of the steps seen so far, for `MeanOverTime`."""

    total: Float[Array, " features"]
    count: Int[Array, ""]
