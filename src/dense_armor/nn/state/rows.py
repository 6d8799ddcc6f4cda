"""Rows into a cache's buffers: the one write every fixed-shape cache makes (`_write_rows`, in
range by construction whatever runtime runs it), an int8 cache's rounding of new rows and its
scales, and the checks of a buffer's shape. Used by `cache`'s classes only."""

import jax.numpy as jnp
from jaxtyping import Array

from ..core import ShapeError
from ..products import quantize_int8


def _heads(a: Array, n_heads: int) -> Array:
    """`(L, n_heads * d_head) -> (n_heads, L, d_head)`."""
    return a.reshape(a.shape[0], n_heads, a.shape[1] // n_heads).transpose(1, 0, 2)


def _refuse_window(window: int | None, owner: str) -> None:
    if window is not None:
        raise ValueError(
            f"{owner}: a windowed layer steps with the ring cache of its own `init_cache()`, and "
            "only a windowed layer does."
        )


def _check_buffers(buffer: Array, new: Array, rows: str, owner: str) -> None:
    if buffer.ndim != 3 or (buffer.shape[0], buffer.shape[2]) != (new.shape[0], new.shape[2]):
        raise ShapeError(
            f"{owner}: received `cache.keys.shape={buffer.shape}`; expected "
            f"`(n_heads={new.shape[0]}, {rows}, d_head={new.shape[2]})`. Use this layer's "
            "`init_cache`."
        )


def _write_rows(
    buffer: Array, rows: Array, slots: Array, last: Array, keep: Array | None = None
) -> Array:
    """`buffer (n_heads, N, d_head)` with `rows (n_heads, K, d_head)` written at rows `slots (K,)`.

    Every index stays inside the buffer by construction, whatever runtime runs the step (XLA
    drops an out-of-range scatter update; IREE writes it, past the end of the buffer): `slots`
    are clipped into `[0, N)`, and a slot that several of the `K` writes share gets the same row
    from each of them, so their order does not matter. `last (K,)` is that row: the one of `rows`
    the slot holds after the write (in `[0, K)`), or, where `keep` is true, the buffer's own row
    (a write that must not land: it writes back what is there).

    One scatter into the leading axis of the buffer seen as `(n_heads * N, d_head)` (a reshape
    that moves nothing): row `slot` of head `h` is row `h * N + slot`. In place under donation;
    under `jax.vmap` (a batch of streams) a scatter with one batching dimension, which every
    StableHLO consumer compiles (IREE rejects the batched dynamic-update-slice into the inner
    axis that a per-head write becomes), so the exported modules for other runtimes and JAX
    write a cache the same way."""
    n_heads, n, d_head = buffer.shape
    slots = jnp.clip(slots, 0, n - 1)
    if isinstance(rows.shape[1], int) and rows.shape[1] == 1:  # a step: its one row
        new = rows.astype(buffer.dtype)
    else:
        new = jnp.take(rows, jnp.clip(last, 0, rows.shape[1] - 1), axis=1, mode="clip")
        new = new.astype(buffer.dtype)
    if keep is not None:
        old = jnp.take(buffer, slots, axis=1, mode="clip")
        new = jnp.where(keep[None, :, None], old, new)
    heads = jnp.arange(n_heads, dtype=slots.dtype)[:, None]
    index = (heads * n + slots[None, :]).reshape(-1)  # (n_heads * K,), each in [0, n_heads * N)
    flat = buffer.reshape(n_heads * n, d_head)
    written = flat.at[index].set(new.reshape(-1, d_head), mode="promise_in_bounds")
    return written.reshape(buffer.shape)


def _quantized(keys: Array, values: Array) -> tuple[Array, Array, Array, Array]:
    """New rows `(n_heads, K, d_head)` as int8 with a scale per head and row, `(n_heads, K, 1)`."""
    (qk, sk), (qv, sv) = quantize_int8(keys, -1), quantize_int8(values, -1)
    return qk, qv, sk, sv


def _scales(buffer: Array | None) -> Array | None:
    """A scale buffer `(n_heads, L, 1)` as the attention reads it, `(n_heads, L)`."""
    return None if buffer is None else buffer[..., 0]


def _zero_scales(buffer: Array) -> Array:
    return jnp.zeros((*buffer.shape[:-1], 1), jnp.float32)
