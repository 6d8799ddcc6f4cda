"""A stream's step counter and what a step past a fixed limit does (`on_overflow`): the one
overflow policy of the fixed key/value cache and of the positional encodings. The modes, the
message's remedy and the rewrite of JAX's log line under plain `jax.jit` are described in
`cache`; its names are re-exported there.
"""

import logging

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ..core import python_scalar, require_choice

__all__ = ["OVERFLOW_MODES", "OVERFLOW_REMEDY", "Counter", "validate_overflow_mode"]


OVERFLOW_MODES = ("raise", "nan")


def validate_overflow_mode(on_overflow: str) -> None:
    require_choice("on_overflow", on_overflow, OVERFLOW_MODES)


# What an overflow error says to do, after what happened (one text for every cache).
OVERFLOW_REMEDY = (
    ": the stream stepped past the last slot. Give `init_cache` a larger capacity, build the "
    "layer with a `window` (a ring cache that never fills), `reset` the stream, or pass "
    "`on_overflow='nan'` for NaN rows and a set `overflow` flag instead of this error (under plain "
    "`jax.jit` XLA wraps it in a ValueError beginning 'INTERNAL: CpuCallback error'; "
    "`eqx.filter_jit` raises it cleanly)"
)


class _OverflowFirst(logging.Filter):
    """Under plain `jax.jit`, an overflow's error arrives from XLA wrapped in a `ValueError`
    ("INTERNAL: CpuCallback error calling callback: Traceback ..."), after JAX logs
    "jax.pure_callback failed" and the callback's traceback. This filter on JAX's callback
    logger rewrites that log line for an overflow, and only for one, so that the first line a
    user reads says what happened: "dense_armor: the key/value cache is full (capacity N): ..."."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and OVERFLOW_REMEDY in str(error):
            record.msg, record.args = "dense_armor: " + str(error).split("\n", 1)[0], ()
        return True


_CALLBACK_LOGGER = logging.getLogger("jax._src.callback")
if not any(isinstance(f, _OverflowFirst) for f in _CALLBACK_LOGGER.filters):
    _CALLBACK_LOGGER.addFilter(_OverflowFirst())


class Counter(eqx.Module):
    """A stream's step counter: the index of the next step, whether a step ever went past the
    limit, what a step past it does (`on_overflow`: "raise" or "nan"), and the limit itself
    (`limit` steps, `None` for none: a fixed cache's capacity, a positional table's `max_len`).
    The mode and the limit are static, so a host that counts the steps it sent knows, without
    reading the device, when the next one would overflow (see `Stream`)."""

    index: Int[Array, ""]
    overflow: Bool[Array, ""]
    on_overflow: str = eqx.field(static=True, converter=python_scalar, default="raise")
    limit: int | None = eqx.field(static=True, converter=python_scalar, default=None)

    @classmethod
    def start(cls, on_overflow: str = "raise", limit: int | None = None) -> "Counter":
        """A counter at 0, its flag clear; the one place the mode is validated."""
        validate_overflow_mode(on_overflow)
        return cls(jnp.zeros((), jnp.int32), jnp.zeros((), bool), on_overflow, limit)

    def advance(self, steps: int) -> tuple[Array, Array, "Counter"]:
        """`(positions (steps,), fits (steps,), counter)`: the positions of the next `steps`
        steps, which of them lie below the limit (all, for `None`), and the counter after them.
        The index never passes the limit, and the flag, once set, stays set."""
        positions = self.index + jnp.arange(steps, dtype=self.index.dtype)
        if self.limit is None:
            after = Counter(self.index + steps, self.overflow, self.on_overflow)
            return positions, jnp.ones(steps, bool), after
        fits = positions < self.limit
        index = jnp.minimum(self.index + steps, self.limit).astype(self.index.dtype)
        overflow = self.overflow | ~fits.all()
        return positions, fits, Counter(index, overflow, self.on_overflow, self.limit)

    def guard(self, y: Array, fits: Array, message: str) -> Array:
        """`y (steps, ...)`, with each row that did not fit failed as `on_overflow` says: the
        step raises `equinox.EquinoxRuntimeError`, or its row is NaN."""
        if self.on_overflow == "raise":
            return eqx.error_if(y, ~fits.all(), message + OVERFLOW_REMEDY)
        rows = fits.reshape(fits.shape + (1,) * (y.ndim - 1))
        return jnp.where(rows, y, jnp.asarray(jnp.nan, y.dtype))
