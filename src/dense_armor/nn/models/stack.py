"""`Stack`: `depth` copies of one layer, their parameters stacked on a leading axis and applied one
after the other by `jax.lax.scan`, so the layer is traced and compiled once whatever the depth
(the "scan over layers" of maxtext, Penzai and Flax's `nnx.scan`).

A stack computes what the unrolled layers compute, with the same weights: `Stack(blocks)` stacks
them, `stack.unstack()` gives them back, and `stack_layers(model)` / `unstack_layers(model)`
convert a whole model (the factories' `scan_layers=True` builds it stacked), so a checkpoint
saved one way loads the other (`load_checkpoint(..., scan_layers=...)`).

Streaming: a stack's cache is its layers' caches stacked on the same leading axis; `step` and
`prefill` scan over the layers and their caches together.
"""

import operator
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from ..core import Layer, python_scalar

__all__ = ["Stack", "scanned", "stack_layers", "unstack_layers"]


class Stack(Layer):
    """`depth` copies of one layer (same class and hyper-parameters, their own weights), applied
    in order by one `jax.lax.scan`.

    **Arguments:** `layers`, the copies; their arrays are stacked, so `stacked`'s arrays have a
    leading axis of `depth`. `forward(x, *args, key=None, **kwargs)` passes `args` and `kwargs`
    (a padding `mask`, a decoder's context) to every layer and splits `key` over them;
    `params()` lists the stacked parameters once, each with its depth axis.
    """

    stacked: Layer
    depth: int = eqx.field(static=True, converter=python_scalar)

    def __init__(self, layers: Sequence[Layer]):
        layers = tuple(layers)
        if not layers:
            raise ValueError("Stack needs at least one layer.")
        if not all(_alike(layer, layers[0]) for layer in layers):
            raise ValueError(
                "Stack: the layers must be copies of one layer (same class and hyper-parameters)."
            )
        self.stacked = jax.tree.map(lambda *arrays: jnp.stack(arrays), *layers)
        self.depth = len(layers)

    # The stacked layer's capabilities (`Layer` declares them as class variables; a Stack's
    # depend on what it holds).
    @property
    def accepts_mask(self) -> bool:  # type: ignore[override]
        return self.stacked.accepts_mask

    @property
    def causal(self) -> bool:  # type: ignore[override]
        return self.stacked.causal

    def unstack(self) -> tuple[Layer, ...]:
        """The layers, each with its own slice of the stacked arrays."""
        params, static = eqx.partition(self.stacked, eqx.is_array)
        return tuple(
            eqx.combine(jax.tree.map(operator.itemgetter(i), params), static)
            for i in range(self.depth)
        )

    def _scan(self, body: Any, carry: Any, per_layer: Any) -> tuple[Any, Any]:
        """`jax.lax.scan` of `body(carry, (layer, per_layer_i))` over the layers."""
        params, static = eqx.partition(self.stacked, eqx.is_array)

        def step(carry: Any, xs: Any) -> tuple[Any, Any]:
            layer_params, item = xs
            return body(carry, (eqx.combine(layer_params, static), item))

        return jax.lax.scan(step, carry, (params, per_layer))

    def forward(self, x: Array, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any) -> Any:
        keys = None if key is None else jr.split(key, self.depth)

        def body(h: Array, xs: tuple[Layer, Any]) -> tuple[Array, None]:
            layer, layer_key = xs
            return layer(h, *args, key=layer_key, **kwargs), None

        return self._scan(body, x, keys)[0]

    def init_cache(self, *args: Any, **kwargs: Any) -> Any:
        """The layers' caches (`init_cache(*args, **kwargs)` of each), stacked: mapped over the
        stacked layers, so that no layer's weights are copied out (an 8B model's layer is 250
        MB that a chip full of weights and caches does not have)."""
        return eqx.filter_vmap(lambda layer: layer.init_cache(*args, **kwargs))(self.stacked)

    def prefill(self, x: Array, cache: Any) -> tuple[Array, Any]:
        """`K` steps through every layer, each with its slice of the stacked `cache`.

        The cache is carried through the scan, not scanned over: layer `i` reads its slice
        `cache[i]` and writes it back in place. Scanned over (`xs` in, `ys` out), a batch of
        streams' caches (`jax.vmap`, the batch axis first) would be moved whole to put the depth
        axis first, and back, at every step: on a TPU, 10 of a 23 ms serving tick."""

        def body(carry: tuple[Array, Any], xs: tuple[Layer, Any]) -> tuple[Any, None]:
            (h, cache), (layer, i) = carry, xs
            # dynamic slices: clamped by definition, in range whatever runs them
            own = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), cache)
            h, new = layer.prefill(h, own)
            cache = jax.tree.map(
                lambda a, n: jax.lax.dynamic_update_index_in_dim(a, n, i, 0), cache, new
            )
            return (h, cache), None

        return self._scan(body, (x, cache), jnp.arange(self.depth))[0]


def _is_stackable(layer: Any) -> bool:
    return isinstance(layer, Layer) and layer.stackable


def _alike(layer: Any, other: Any) -> bool:
    """Copies of one layer: the same class and hyper-parameters (its static fields, which the
    tree's structure holds: a window or a rotary base apart is another layer), so the same array
    structure."""
    structure: Any = jax.tree.structure(layer)  # compares, untyped
    return type(layer) is type(other) and structure == jax.tree.structure(other)


def scanned(blocks: Sequence[Layer]) -> Any:
    """`blocks` for a scan over layers: one `Stack` when they are copies of one block; else, when
    they repeat with a period (Gemma 2's sliding and global layers in turn, Gemma 3's five sliding
    to one global), a `Stack` of `Sequential` groups of one period each, then the blocks left
    over, as a tuple; a pattern that does not repeat stays unrolled (a tuple)."""
    from .sequential import Sequential  # a Stack may hold a Sequential: imported when needed

    blocks = tuple(blocks)
    if all(_alike(block, blocks[0]) for block in blocks):
        return Stack(blocks)
    for period in range(2, len(blocks)):
        if all(_alike(b, blocks[i % period]) for i, b in enumerate(blocks)):
            groups = len(blocks) // period
            stacked = Stack(
                [Sequential(*blocks[g * period : (g + 1) * period]) for g in range(groups)]
            )
            return (stacked, *blocks[groups * period :])
    return blocks


def _restack(layers: Sequence[Any]) -> tuple[Any, ...]:
    """`layers` with each run of alike blocks replaced by one `Stack` of them (a mixed stack's
    blocks of different kinds stay apart)."""
    out: list[Any] = []
    run: list[Any] = []
    for layer in [*layers, None]:
        if layer is not None and _is_stackable(layer) and (not run or _alike(layer, run[0])):
            run.append(layer)
            continue
        if run:
            out.append(Stack(run))
            run = []
        if layer is not None and _is_stackable(layer):
            run.append(layer)
        elif layer is not None:
            out.append(layer)
    return tuple(out)


def _flatten(layers: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(
        sub
        for layer in layers
        for sub in (layer.unstack() if isinstance(layer, Stack) else [layer])
    )


def stack_layers(model: Any) -> Any:
    """`model` (a `Sequential` or a `TransformerDecoder`) with its blocks in one `Stack`."""
    return _convert(model, _restack)


def unstack_layers(model: Any) -> Any:
    """`model` with every `Stack` replaced by the layers it holds: the unrolled model."""
    return _convert(model, _flatten)


def _convert(model: Any, how: Any) -> Any:
    field = model.layers_field if isinstance(model, Layer) else None
    if field is None:
        raise TypeError(
            f"stack_layers/unstack_layers take a Sequential or a TransformerDecoder; received "
            f"{type(model).__name__}."
        )
    return eqx.tree_at(lambda m: getattr(m, field), model, how(getattr(model, field)))
