"""The serving engine's compiled functions: a chunk's prefill, a slot's admission, the tick."""

from typing import Any

import equinox as eqx
import jax

from ..nn.models.language_model import TransformerLM
from ..nn.sampling import draw_rows
from ..nn.state.streams import reset

__all__ = ["admit", "prefill", "tick"]


@eqx.filter_jit
def prefill(model: TransformerLM, ids: jax.Array, cache: Any) -> Any:
    return model.prefill(ids, cache)[1]


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
    tokens: jax.Array,
    positions: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
) -> tuple[jax.Array, Any]:
    """Every slot's `step` on its token, and the token each slot's logits choose with its own
    rules and key (`draw_rows`: slot `b` at position `p` draws with `fold_in(keys[b], p)`)."""
    logits, caches = jax.vmap(model.step)(tokens, caches)
    chosen = draw_rows(logits, keys, positions, temperature, top_k, top_p, min_p)
    return chosen, caches
