"""Rotary position embedding (Su et al. 2021, "RoFormer"): queries and keys rotated by their
step index, so that their dot product depends only on how far apart the steps are.

The convention is that of GPT-NeoX, Llama and Equinox's `RotaryPositionalEmbedding` ("rotate
half"): in a head of `d_head` features, feature `i` and feature `i + d_head / 2` rotate together,
by the angle `position * base ** (-2 i / d_head)`, for `i < d_head / 2`. (The RoFormer paper pairs
neighbouring features `2i` and `2i + 1` instead: the same function of a permuted head.)
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["rotate"]


def rotate(
    x: Float[Array, "*heads L d_head"], positions: Int[Array, " L"], base: float = 10000.0
) -> Float[Array, "*heads L d_head"]:
    """`x` rotated by `positions (L,)`, in float32, returned in the dtype of `x`."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])
    angles = positions.astype(jnp.float32)[:, None] * frequencies[None, :]  # (L, half)
    leading = (1,) * (x.ndim - 2)  # explicit: no implicit rank promotion
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1).reshape(*leading, *x.shape[-2:])
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1).reshape(*leading, *x.shape[-2:])
    x32 = x.astype(jnp.float32)
    rotated_half = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated_half * sin).astype(x.dtype)
