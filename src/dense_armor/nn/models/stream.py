"""`Stream`: one stream through a causal model, stepped from Python at the speed of its compiled
step, a full cache raised on the host before the step that would overflow it.

A layer's `step` with its default cache (`on_overflow="raise"`) checks for overflow inside the
compiled step, with `eqx.error_if`: a callback to Python. XLA's CPU runtime runs every executable
that holds a host callback synchronously, on the calling thread, so such a step never overlaps
with the Python that prepares the next one (on a 2-core CPU: about 65 against 50 us for one
attention layer's step). A `Stream` keeps the raise without the callback: its cache is in the
callback-free `"nan"` mode, and it counts the steps it sends. Every counter's limit is static (a
fixed cache's capacity, a positional table's `max_len`: `Counter.limit`), so the host knows, before
a step, whether it would pass the smallest of them, and raises then, the cache untouched.

A `Stream` also holds the model's arrays and the cache's as flat lists, so a call flattens no
Module (the model's flatten is a third of a small step's dispatch), and it donates the cache to
each step, so the step writes it in place. It compiles once per shape: one `step`, one `prefill`
per chunk length.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..core import require_int
from ..state.counter import Counter

__all__ = ["Stream"]

_PROTOCOL = ("init_cache", "step", "prefill")


def _limit(cache: Any) -> int | None:
    """The smallest limit of the cache's counters (`None` if none has one)."""
    counters = jax.tree_util.tree_leaves(cache, is_leaf=lambda node: isinstance(node, Counter))
    limits = [c.limit for c in counters if isinstance(c, Counter) and c.limit is not None]
    return min(limits) if limits else None


class Stream:
    """One stream through `model` (a causal layer or model with `init_cache`, `step` and
    `prefill`), with a fixed cache of `capacity` steps (`None`: the model's growing cache, which
    compiles again at every length; a windowed or recurrent model needs none). A decoder streams
    against a `context` (and its `context_mask`), given here once for the stream's life.

    `step(x_t)` returns the output of one step and `prefill(x)` of `K` steps at once, as the
    model's `step` and `prefill` do; `reset()` empties the stream. A step or prefill that would
    take the stream past `limit` steps raises `equinox.EquinoxRuntimeError` (the exception of a
    full cache's `step`), before it runs: `position` and the cache are as they were.

    The model's arrays are read once, at construction: a `Stream` serves a trained model, and a
    new model (new weights) needs a new `Stream`."""

    def __init__(
        self,
        model: Any,
        capacity: int | None,
        *,
        context: Any = None,
        context_mask: Any = None,
    ) -> None:
        if not all(callable(getattr(model, name, None)) for name in _PROTOCOL):
            raise TypeError(
                "Stream: expected a model that streams (with `init_cache`, `step` and "
                f"`prefill`); received {type(model).__name__}."
            )
        if capacity is not None:
            require_int(capacity=capacity, caller="Stream")
        needs_context = "context" in inspect.signature(model.init_cache).parameters
        if needs_context != (context is not None):
            raise TypeError(
                f"Stream: {type(model).__name__} streams against a context: pass `context=` "
                "(and `context_mask=` if it has padding)."
                if needs_context
                else f"Stream: {type(model).__name__} takes no context; received `context=`."
            )
        if context_mask is not None and context is None:
            raise TypeError("Stream: `context_mask` needs a `context`.")
        self._model, self._capacity = model, capacity
        self._context = (context, context_mask)
        params, static = eqx.partition(model, eqx.is_array)
        self._params, params_def = jax.tree_util.tree_flatten(params)
        cache = self._fresh()
        self._cache, cache_def = jax.tree_util.tree_flatten(cache)
        self._cache_def = cache_def
        self._limit, self._position = _limit(cache), 0

        def run(method: str, leaves: list, x: Any, cache_leaves: list) -> tuple[Any, list]:
            layer = eqx.combine(jax.tree_util.tree_unflatten(params_def, leaves), static)
            cache = jax.tree_util.tree_unflatten(cache_def, cache_leaves)
            y, new = getattr(layer, method)(x, cache)
            new_leaves, new_def = jax.tree_util.tree_flatten(new)
            if new_def != cache_def:  # type: ignore[operator]
                raise TypeError(
                    f"Stream: {type(model).__name__}.{method} returned a cache of another "
                    f"structure than its `init_cache`: {new_def} against {cache_def}."
                )
            return y, new_leaves

        self._run: dict[str, Callable] = {
            method: jax.jit(functools.partial(run, method), donate_argnums=2)
            for method in ("step", "prefill")
        }

    @property
    def model(self) -> Any:
        return self._model

    @property
    def position(self) -> int:
        """The steps taken since construction or the last `reset()`."""
        return self._position

    @property
    def limit(self) -> int | None:
        """The steps the stream can take: the smallest limit of its cache's counters (a fixed
        cache's capacity, a positional table's `max_len`), `None` if it has none."""
        return self._limit

    @property
    def cache(self) -> Any:
        """A copy of the stream's cache (the stream's own buffers are donated to its next step)."""
        return jax.tree_util.tree_unflatten(self._cache_def, [jnp.copy(a) for a in self._cache])

    def _advance(self, method: str, x: Any, steps: int) -> Any:
        if self._limit is not None and self._position + steps > self._limit:
            raise eqx.EquinoxRuntimeError(
                f"Stream.{method}: the stream is full: {self.position} of its {self.limit} "
                f"steps taken, and this {method} needs {steps}. The limit is the smallest of the "
                "model's cache capacities and positional `max_len`s. Build the Stream with a "
                "larger capacity, build the layers with a `window` (a ring cache that never "
                "fills), or `reset()` the stream."
            )
        if not isinstance(x, jax.Array):
            x = jnp.asarray(x)
        y, self._cache = self._run[method](self._params, x, self._cache)
        self._position += steps
        return y

    def step(self, x_t: Any) -> Any:
        """The output of the next step for the input row `x_t`."""
        return self._advance("step", x_t, 1)

    def prefill(self, x: Any) -> Any:
        """The outputs of the next `K` steps for the chunk `x` (its leading axis: `K` rows)."""
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        if x.ndim == 0:
            raise TypeError(
                "Stream.prefill: expected a chunk of steps (a leading axis of `K` rows); received "
                f"a scalar {x!r}. A single step is `step(x_t)`."
            )
        return self._advance("prefill", x, int(x.shape[0]))

    def _fresh(self) -> Any:
        """An empty cache, in the callback-free mode, in buffers of its own: each step donates
        them, and a cache may hold a caller's array (a decoder's `context_mask`)."""
        context, mask = self._context
        if context is None:
            cache = self._model.init_cache(self._capacity, on_overflow="nan")
        else:
            cache = self._model.init_cache(
                context, self._capacity, context_mask=mask, on_overflow="nan"
            )
        return jax.tree_util.tree_map(jnp.copy, cache)

    def reset(self) -> None:
        """Empty the stream: a fresh cache (against the same context), `position` 0."""
        self._cache, self._position = jax.tree_util.tree_leaves(self._fresh()), 0

    def __repr__(self) -> str:
        return (
            f"Stream({type(self._model).__name__}, capacity={self._capacity}, "
            f"position={self.position}, limit={self.limit})"
        )
