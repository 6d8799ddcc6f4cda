"""The `Server`'s settings, checked, and the keys its requests draw with."""

from typing import Any

import jax
import jax.numpy as jnp

from ..nn.core import require_int
from ..nn.models.language_model import TransformerLM

__all__ = ["capacity_of", "key_data", "paging", "request_key"]


def key_data(key: jax.Array) -> jax.Array:
    """A key's raw data (uint32), for a typed key or a legacy `PRNGKey`."""
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


@jax.jit
def request_key(key: jax.Array, number: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, number)


def capacity_of(model: TransformerLM, capacity: int | None) -> int:
    """The cache slots per stream: `capacity`, default the model's positions' end, else 256."""
    end = model.positions_end
    capacity = (end or 256) if capacity is None else capacity
    require_int(1, caller="Server", capacity=capacity)
    if end is not None and capacity > end:
        raise ValueError(
            f"Server: `capacity={capacity}` passes the model's positions, which end at {end} "
            "(its learned positions' max_len, or LongRoPE's pretrained length)."
        )
    return int(capacity)


def paging(pages: Any, page_size: Any, share: Any) -> tuple[int, int, bool | None] | None:
    """The paged cache's settings, checked (None: fixed slots)."""
    if pages is None:
        if share:
            raise ValueError("Server: `share_prefixes` shares pages: give `pages` too.")
        return None
    require_int(2, caller="Server", pages=pages)
    require_int(1, caller="Server", page_size=page_size)
    if share is not None and not isinstance(share, bool):
        raise TypeError(
            f"Server: `share_prefixes` must be True, False or None; received {share!r}."
        )
    return int(pages), int(page_size), share
