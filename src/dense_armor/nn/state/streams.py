"""A batch of streams: a cache with a leading batch axis on every array (`batch_streams`, or
`init_cache` under `jax.vmap`), every stream with its own counters; `reset` returns chosen
streams to their empty state and leaves the others untouched."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from ..core import ShapeError, require_int
from .cache import KeyValueCache

__all__ = ["batch_streams", "reset"]


def _is_growing(node: Any) -> bool:
    return isinstance(node, KeyValueCache) and not node.fixed_shape


def _refuse_growing(cache: Any, what: str) -> None:
    if any(_is_growing(n) for n in jax.tree.leaves(cache, is_leaf=_is_growing)):
        raise ValueError(
            f"{what}: a growing cache (`init_cache()` without a capacity) holds one stream of its "
            "own length; build a batch of streams with `init_cache(capacity)`."
        )


def batch_streams(cache: Any, batch: int) -> Any:
    """`cache` repeated for `batch` streams: every array with a leading batch axis, ready for
    `jax.vmap(model.step)(x_t, caches)`."""
    _refuse_growing(cache, "batch_streams")
    require_int(1, batch=batch)
    batch = int(batch)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *jnp.shape(a))).copy(), cache)


def reset(cache: Any, streams: Bool[Array, " B"], fresh: Any = None) -> Any:
    """A batch of streams' `cache` with the streams where `streams (B,)` is true returned to
    `fresh` (default: the empty state, all zeros: counters at 0, flags false), and the others
    untouched. `fresh` is one stream's cache (for every chosen stream) or a batch of them; a
    decoder's new stream needs its context: pass `fresh=model.init_cache(new_context, ...)`."""
    _refuse_growing(cache, "reset")
    streams = jnp.asarray(streams)
    leaves = jax.tree.leaves(cache)
    if streams.dtype != bool or streams.ndim != 1:
        raise ShapeError(
            f"reset: `streams` must be a boolean vector, one entry per stream; received shape "
            f"{streams.shape} dtype {streams.dtype}."
        )
    for leaf in leaves:
        if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != streams.shape[0]:
            raise ShapeError(
                f"reset: the cache's arrays must have a leading axis of {streams.shape[0]} streams "
                f"(a batch of streams from `batch_streams` or `jax.vmap`); one has shape "
                f"{jnp.shape(leaf)}."
            )
    fresh = jax.tree.map(jnp.zeros_like, cache) if fresh is None else fresh

    def check(old: Array, new: Array) -> None:
        if jnp.shape(new) not in (jnp.shape(old), jnp.shape(old)[1:]):
            raise ShapeError(
                f"reset: `fresh` holds an array of shape {jnp.shape(new)} where the cache holds "
                f"{jnp.shape(old)}: pass one stream's cache or a batch of {jnp.shape(old)[0]}."
            )

    fresh_leaves = jax.tree.leaves(fresh)
    if len(fresh_leaves) == len(leaves):
        # the arrays first: a cache of another capacity also differs in its counters' limit,
        # and its shapes say what is wrong
        for old, new in zip(leaves, fresh_leaves, strict=True):
            check(old, new)
    fresh_structure: Any = jax.tree.structure(fresh)  # PyTreeDef compares, though untyped
    if fresh_structure != jax.tree.structure(cache):
        raise ShapeError(
            "reset: `fresh` must be a cache of the same model (from its `init_cache`); its "
            "structure differs from the cache's."
        )

    def pick(old: Array, new: Array) -> Array:
        chosen = streams.reshape(streams.shape + (1,) * (jnp.ndim(old) - 1))
        return jnp.where(chosen, jnp.broadcast_to(new, jnp.shape(old)), old)

    return jax.tree.map(pick, cache, fresh)
