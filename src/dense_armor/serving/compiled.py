"""The serving engine's compiled functions: a chunk's prefill, a slot's admission, the tick (of
fixed slots, or of paged ones: `paged_tick`), a paged stream's start."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn.models.language_model import TransformerLM
from ..nn.sampling import draw_rows
from ..nn.state.counter import Counter
from ..nn.state.paged import PagedKVCache, pool_mask, stream_axes, with_tables
from ..nn.state.streams import reset

__all__ = ["admit", "paged_tick", "prefill", "paged_prefill", "start_stream", "tick"]


@eqx.filter_jit
def prefill(model: TransformerLM, ids: Any, cache: Any) -> Any:
    return model.prefill(ids, cache)[1]


@eqx.filter_jit(donate="all-except-first")  # the pools and the stream's state in place
def paged_prefill(
    model: TransformerLM, ids: Any, pools: Any, own: Any, table: Any
) -> tuple[Any, Any]:
    """`prefill` of one paged stream: `pools` (shared) and `own` (its counters and states), its
    pages those `table` lists; its own table comes back as it came."""
    cache = eqx.combine(pools, with_tables(own, table))
    cache = model.prefill(ids, cache)[1]
    return _parted(cache, own)


def _parted(cache: Any, own: Any) -> tuple[Any, Any]:
    """The pools and the streams' own states of `cache`, the latter with `own`'s tables."""
    pools, stepped = eqx.partition(cache, pool_mask(cache))
    paged = jax.tree.leaves(own, is_leaf=lambda n: isinstance(n, PagedKVCache))
    table = next(n.table for n in paged if isinstance(n, PagedKVCache))
    return pools, with_tables(stepped, table)


@eqx.filter_jit(donate="all-except-first")
def admit(new: tuple[jax.Array, Any], caches: Any) -> Any:
    """`caches` with the slots where `chosen` is true replaced by `cache` (`new`); the old
    caches' buffers donated, so the slots' memory is updated in place."""
    chosen, cache = new
    return reset(caches, chosen, cache)


@eqx.filter_jit(donate="all-except-first")  # the caches are updated in place
def tick(
    model: TransformerLM,
    caches: Any,
    tokens: Any,
    positions: Any,
    keys: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    min_p: Any,
) -> tuple[jax.Array, Any]:
    """Every slot's `step` on its token, and the token each slot's logits choose with its own
    rules and key (`draw_rows`: slot `b` at position `p` draws with `fold_in(keys[b], p)`)."""
    logits, caches = jax.vmap(model.step)(tokens, caches)
    chosen = draw_rows(logits, keys, positions, temperature, top_k, top_p, min_p)
    return chosen, caches


@eqx.filter_jit(donate="all-except-first")  # the pools and the slots' states in place
def paged_tick(
    model: TransformerLM,
    pools: Any,
    own: Any,
    rows: Any,
    tables: Any,
    *arrays: Any,
) -> tuple[jax.Array, Any, Any]:
    """`tick` over the paged slots `rows (R,)` (distinct): `pools` (shared) and `own` (every
    slot's counters and states, `eqx.partition`ed by `pool_mask`), slot `rows[r]` reading the
    pages `tables[r]` lists, with the tick's arrays of those slots; the tokens they choose
    `(R,)`. The other slots' states, and every slot's own table (the host owns the tables),
    come back as they came."""
    rows = jnp.clip(rows, 0, jax.tree.leaves(own)[0].shape[0] - 1)
    chosen_own = jax.tree.map(lambda a: a[rows], own)
    caches = eqx.combine(pools, with_tables(chosen_own, tables))
    axes = stream_axes(caches)
    step = jax.vmap(model.step, in_axes=(0, axes), out_axes=(0, axes))
    tokens, positions, keys, temperature, top_k, top_p, min_p = arrays
    logits, caches = step(tokens, caches)
    chosen = draw_rows(logits, keys, positions, temperature, top_k, top_p, min_p)
    pools, stepped = _parted(caches, chosen_own)
    own = jax.tree.map(lambda a, new: a.at[rows].set(new, mode="promise_in_bounds"), own, stepped)
    return chosen, pools, own


@eqx.filter_jit
def start_stream(fresh: Any, table: Any, index: Any) -> Any:
    """A paged stream's own state at its start: its `table`, every counter at `index` (past the
    shared prefix its pages hold already)."""

    def one(node: Any) -> Any:
        if isinstance(node, Counter):
            return eqx.tree_at(lambda c: c.index, node, jnp.asarray(index, node.index.dtype))
        return node

    return jax.tree.map(one, with_tables(fresh, table), is_leaf=lambda n: isinstance(n, Counter))
