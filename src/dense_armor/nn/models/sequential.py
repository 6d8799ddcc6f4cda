"""`Sequential`: layers applied one after the other, streaming through the tuple of their caches."""

from typing import Any, ClassVar

import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from ..core import Layer, check_steps
from ..state.counter import validate_overflow_mode
from ..state.streams import batch_streams

__all__ = ["Sequential"]


def _apply(layer: Layer, x: Array, mask: Array | None, key: PRNGKeyArray | None) -> Array:
    """`layer(x)`, with the padding `mask` when the layer takes one."""
    if mask is not None and layer.accepts_mask:
        return layer(x, mask=mask, key=key)
    return layer(x, key=key)


class Sequential(Layer):
    """Layers applied one after the other.

    `forward(x, key=key)` splits `key` over the layers. `params()` lists the layers' parameters in
    order. Streaming: the cache is the tuple of the layers' caches, and `step` threads `x_t` and
    each cache through the layers.
    """

    layers: tuple[Layer, ...]
    layers_field: ClassVar[str | None] = "layers"

    def __init__(self, *layers: Layer):
        if not layers:
            raise ValueError("Sequential needs at least one layer.")
        self.layers = tuple(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Layer:
        return self.layers[i]

    def forward(
        self, x: Array, *, mask: Array | None = None, key: PRNGKeyArray | None = None
    ) -> Array:
        """`x` through every layer; the padding `mask` (`Layer`) goes to the layers that take
        one (attention, blocks, `MeanOverTime`)."""
        keys = [None] * len(self.layers) if key is None else list(jr.split(key, len(self.layers)))
        for layer, layer_key in zip(self.layers, keys, strict=True):
            x = _apply(layer, x, mask, layer_key)
        return x

    def init_cache(
        self, capacity: int | None = None, *, on_overflow: str = "raise"
    ) -> tuple[Any, ...]:
        """The tuple of the layers' caches (`capacity=None`: growing; an int: fixed)."""
        validate_overflow_mode(on_overflow)
        return tuple(layer.init_cache(capacity, on_overflow=on_overflow) for layer in self.layers)

    def _check_caches(self, cache: Any, method: str) -> None:
        if not isinstance(cache, tuple) or len(cache) != len(self.layers):
            received = f"a tuple of {len(cache)}" if isinstance(cache, tuple) else type(cache)
            raise ValueError(
                f"Sequential.{method}: expected a tuple of {len(self.layers)} layer caches from "
                f"`init_cache`; received {received}."
            )

    def check_step(self, x_t: Any, cache: Any) -> None:
        """`step`'s own check: the caches, and `x_t` one step of the first layer's width."""
        self._check_caches(cache, "step")
        check_steps("Sequential.step", "x_t", x_t, self._n_in(), one_step=True)

    def _n_in(self) -> int | None:
        """The input width, where the first layer says it (a `Dense`); else None."""
        width = getattr(self.layers[0], "n_in", None)
        return width if isinstance(width, int) else None

    def prefill(self, x: Array, cache: tuple[Any, ...]) -> tuple[Array, tuple[Any, ...]]:
        """`K` steps at once through every layer, `x (K, features)`: what `K` calls of `step`
        return, stacked (a model that pools over time returns its output after each step)."""
        self._check_caches(cache, "prefill")
        check_steps("Sequential.prefill", "x", x, self._n_in(), one_step=False)
        new = []
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x, layer_cache = layer.prefill(x, layer_cache)
            new.append(layer_cache)
        return x, tuple(new)

    def init_streams(
        self, batch: int, capacity: int | None = None, *, on_overflow: str = "raise"
    ) -> tuple[Any, ...]:
        """`init_cache(capacity)` for `batch` streams: every array with a leading batch axis,
        for `jax.vmap(model.step)(x_t, caches)`; `reset` returns chosen streams to the start."""
        return batch_streams(self.init_cache(capacity, on_overflow=on_overflow), batch)
