"""Positional encodings: what tells attention where each step sits in the sequence.

`sinusoidal_encoding` and `sinusoidal_positions` compute the fixed pattern of Vaswani et al. 2017
(page 6); `AddPositions` adds it to a sequence; `LearnedPositions` adds a learned table. Both add
the row of position `t` to step `t`, bounded by `max_len`, and both stream: the step counter
lives in their cache.
"""

import math

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..core import (
    Layer,
    Param,
    ShapeError,
    python_scalar,
    require_int,
    require_key,
    require_positive,
    shape_checked,
)
from ..state.cache import PositionCache
from ..state.counter import Counter

__all__ = [
    "AddPositions",
    "LearnedPositions",
    "PositionalEncoding",
    "sinusoidal_encoding",
    "sinusoidal_positions",
]


def sinusoidal_encoding(positions: Int[Array, "*P"], d_model: int) -> Float[Array, "*P d_model"]:
    """The sinusoidal encoding of the given integer positions (Vaswani et al. 2017, page 6).

    Column `2i` is `sin(pos / 10000^(2i/d_model))` and column `2i+1` the cosine of the same angle.
    Defined for any position, so a traced step counter works under `jax.jit`.
    """
    require_positive(d_model=d_model)
    half = (d_model + 1) // 2
    frequencies = np.exp(-math.log(10000.0) * 2.0 * np.arange(half) / d_model)
    angles = jnp.tensordot(
        jnp.asarray(positions, jnp.float32), jnp.asarray(frequencies, jnp.float32), axes=0
    )
    pairs = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pairs.reshape(*angles.shape[:-1], 2 * half)[..., :d_model]


def sinusoidal_positions(length: int, d_model: int) -> Float[Array, "length d_model"]:
    """The fixed table of sines and cosines for positions `0 .. length-1`, `(length, d_model)`.

    Row 1 of `sinusoidal_positions(4, 4)` is `[sin(1), cos(1), sin(0.01), cos(0.01)]`.
    """
    require_int(0, length=length)
    return sinusoidal_encoding(jnp.arange(int(length)), d_model)


class PositionalEncoding(Layer):
    """Base class of the layers that add a row per position, for positions `0 .. max_len-1`.

    A subclass gives `rows(positions, d_model)`. A sequence longer than `max_len` raises
    `ShapeError` in `forward`; a step at position `max_len` or later fails as the cache's
    `on_overflow` says (raise, or NaN output and the cache's `overflow` flag). `max_len=None`
    (only for a pattern defined everywhere, such as the sinusoid) sets no bound.
    """

    max_len: int | None = eqx.field(static=True, converter=python_scalar)

    def rows(self, positions: Int[Array, "*P"], d_model: int) -> Float[Array, "*P d_model"]:
        raise NotImplementedError

    @shape_checked
    def forward(
        self, x: Float[Array, "T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "T d_model"]:
        if self.max_len is not None and x.shape[0] > self.max_len:
            raise ShapeError(
                f"{type(self).__name__}.forward: received a sequence of `T={x.shape[0]}` steps "
                f"(`x.shape={x.shape}`); expected at most `max_len={self.max_len}`."
            )
        return x + self.rows(jnp.arange(x.shape[0]), x.shape[1]).astype(x.dtype)

    def init_cache(
        self, capacity: int | None = None, *, on_overflow: str = "raise"
    ) -> PositionCache:
        """A step counter at 0. `capacity` is not needed here (the bound is `max_len`)."""
        return PositionCache(Counter.start(on_overflow, self.max_len))

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: PositionCache
    ) -> tuple[Float[Array, "K d_model"], PositionCache]:
        """Add the rows of the next `K` positions to `x`, and count `K` steps; a position at or
        past `max_len` fails as the counter's `on_overflow` says."""
        positions, fits, counter = cache.counter.advance(x.shape[0])
        if self.max_len is not None:  # a row past the table is never read (its output fails)
            positions = jnp.clip(positions, 0, self.max_len - 1)
        y = x + self.rows(positions, x.shape[1]).astype(x.dtype)
        message = f"{type(self).__name__}: step at a position >= max_len={self.max_len}"
        return counter.guard(y, fits, message), PositionCache(counter)


class LearnedPositions(PositionalEncoding):
    """A learned table `P` of shape `(max_len, d_model)`; adds `P[:T]` to a sequence of `T` steps.

    **Arguments:** `max_len`, `d_model`, `key`. `P` starts normal with std 0.02 (our choice; the
    paper gives none). `params()` is `[P]`.
    """

    P: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)

    def __init__(self, max_len: int, d_model: int, key: PRNGKeyArray):
        require_key(key)
        require_positive(max_len=max_len, d_model=d_model)
        self.P = Param(0.02 * jr.normal(key, (max_len, d_model)))
        self.max_len = max_len
        self.d_model = d_model

    def rows(self, positions: Int[Array, "*P"], d_model: int) -> Float[Array, "*P d_model"]:
        # clipped here too: every index of the gather inside the table, whatever the runtime
        inside = jnp.clip(positions, 0, self.P.value.shape[0] - 1)
        return jnp.take(self.P.value, inside, axis=0, mode="clip")


class AddPositions(PositionalEncoding):
    """Add the sinusoidal pattern of `sinusoidal_positions` to the input. No parameters.

    **Arguments:** `max_len`, the longest sequence (and the last step) it accepts; `None` for no
    bound, as in a sliding-window model that streams forever (float32 angles lose precision past
    about 2**24 steps). The width is the input's.
    """

    def __init__(self, max_len: int | None):
        if max_len is not None:
            require_positive(max_len=max_len)
        self.max_len = max_len

    def rows(self, positions: Int[Array, "*P"], d_model: int) -> Float[Array, "*P d_model"]:
        return sinusoidal_encoding(positions, d_model)
