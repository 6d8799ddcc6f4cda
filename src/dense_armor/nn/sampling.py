"""Sampling rules: the next token from a language model's logits, plain functions of the logits
and a key.

`sample(logits, key, temperature=, top_k=, top_p=, min_p=)` draws from the softmax of the logits
after the rules, applied in transformers' order: the temperature divides the logits, then top-k,
top-p (nucleus) and min-p each remove tokens (their logits become `-inf`; `filter_logits` returns
what is left). `temperature=0` is `greedy`, the argmax (the first of equal maxima, as
`jnp.argmax`). The same key gives the same tokens; the rules run under `jax.jit` and in an
exported graph (their settings are Python numbers, fixed when traced).

- top-k keeps the `top_k` largest logits (every token tied with the `top_k`-th largest too).
- top-p keeps the most probable tokens whose probabilities, taken from the largest down, first
  reach `top_p`: a token stays while the mass of the tokens more probable than it is below
  `top_p` (transformers' rule, from the other end of the sorted list); ties with the last token
  kept stay.
- min-p keeps the tokens whose probability is at least `min_p` times the largest.

The most probable token always stays, so a row never ends with nothing to draw from.

Penalties (`nn.penalties`) change the logits before these rules.
"""

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .core import require_int, require_key, type_checked

__all__ = [
    "check_sampling",
    "draw_rows",
    "draw_tokens",
    "filter_logits",
    "filter_rows",
    "greedy",
    "sample",
    "score_rows",
]


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def check_sampling(
    temperature: Any = 1.0, top_k: Any = None, top_p: Any = None, min_p: Any = None
) -> None:
    """Refuse a sampling setting out of its range, naming it: `temperature` a finite number
    `>= 0`, `top_k` a positive integer, `top_p` a number in `(0, 1]`, `min_p` one in `[0, 1]`
    (each of the last three `None` for off)."""
    if not _real(temperature) or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"`temperature` must be a finite number >= 0 (0 is greedy); received "
            f"`temperature={temperature!r}` ({type(temperature).__name__})."
        )
    if top_k is not None:
        require_int(1, caller="sampling (or None)", top_k=top_k)
    if top_p is not None and (not _real(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(
            f"`top_p` must be a number in (0, 1] (or None); received `top_p={top_p!r}` "
            f"({type(top_p).__name__})."
        )
    if min_p is not None and (not _real(min_p) or not 0.0 <= min_p <= 1.0):
        raise ValueError(
            f"`min_p` must be a number in [0, 1] (or None); received `min_p={min_p!r}` "
            f"({type(min_p).__name__})."
        )


@type_checked
def greedy(logits: Float[Array, "*B vocab"]) -> Int[Array, "*B"]:
    """The most probable token of each row: the argmax over the last axis, as `int32`."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _checked_logits(logits: Any) -> Array:
    """`logits` as a JAX array, refused unless floating point with a vocabulary axis."""
    shape, dtype = getattr(logits, "shape", None), getattr(logits, "dtype", None)
    floating = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
    if shape is None or len(shape) < 1 or shape[-1] < 1 or not floating:
        received = type(logits).__name__ if shape is None else f"shape {shape} dtype {dtype}"
        raise ValueError(
            f"sampling: `logits` must be a floating-point array `(..., vocab)`, vocab >= 1; "
            f"received {received}."
        )
    return jnp.asarray(logits)


def _softmax(logits: Array) -> Array:
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def filter_logits(
    logits: Float[Array, "*B vocab"],
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Float[Array, "*B vocab"]:
    """The logits `sample` draws from, in float32: divided by `temperature` (`0` counts as 1:
    greedy needs no scaling), the tokens that top-k, top-p and min-p remove set to `-inf`."""
    check_sampling(temperature, top_k, top_p, min_p)
    logits = _checked_logits(logits).astype(jnp.float32)
    if temperature > 0:
        logits = logits / temperature
    removed = jnp.float32(-jnp.inf)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, int(top_k))[0][..., -1:]
        logits = jnp.where(logits < kth, removed, logits)
    if top_p is not None and top_p < 1.0:
        logits = jnp.where(_top_p_removes(logits, top_p), removed, logits)
    if min_p is not None and min_p > 0.0:
        logits = jnp.where(_min_p_removes(logits, min_p), removed, logits)
    return logits


def _top_p_removes(logits: Array, top_p: Any) -> Array:
    """Where top-p removes a token (`top_p` a number, or one per row as `(B, 1)`)."""
    probs = _softmax(logits)
    descending = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(descending, axis=-1) - descending  # the mass of the more probable
    kept = jnp.where(before < top_p, descending, jnp.inf)
    return probs < jnp.min(kept, axis=-1, keepdims=True)


def _min_p_removes(logits: Array, min_p: Any) -> Array:
    """Where min-p removes a token (`min_p` a number, or one per row as `(B, 1)`)."""
    probs = _softmax(logits)
    return probs < min_p * jnp.max(probs, axis=-1, keepdims=True)


def sample(
    logits: Float[Array, "*B vocab"],
    key: PRNGKeyArray,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Int[Array, "*B"]:
    """A token for each row of `logits`, drawn with `key` from the softmax of `filter_logits`
    (`temperature=0`: `greedy`, the key unused). `int32`, the shape of `logits` less its last
    axis."""
    require_key(key)
    check_sampling(temperature, top_k, top_p, min_p)
    if temperature == 0:
        return greedy(_checked_logits(logits))
    kept = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return jax.random.categorical(key, kept, axis=-1).astype(jnp.int32)


def draw_tokens(
    logits: Float[Array, "B vocab"],
    key: PRNGKeyArray,
    rows: Int[Array, " B"],
    positions: Int[Array, " B"],
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Int[Array, " B"]:
    """The next token of each of a batch of streams, the rule that makes a stream's tokens its
    own: greedy (`temperature=0`), or stream `b` drawn by `sample` with the key
    `fold_in(fold_in(key, rows[b]), positions[b])`, `rows[b]` the stream's number (its row in
    `generate`, its request in a `Server`) and `positions[b]` the position of the token it
    draws. `generate`, the serving loop and an exported `sample_step` all draw with it."""
    if temperature == 0:
        return greedy(logits)

    def draw(row_logits: Array, row: Array, position: Array) -> Array:
        row_key = jax.random.fold_in(jax.random.fold_in(key, row), position)
        return sample(
            row_logits, row_key, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )

    return jax.vmap(draw)(logits, rows, positions)


# Per-row rules: each row of a batch its own temperature, top-k, top-p, min-p and key, as arrays
# (one compilation whatever the mix; a serving tick's slots). Each rule is `filter_logits`'s
# (top-k by a sort instead of `lax.top_k`, the same k-th value), applied where a row has it on.


def _rows_top_k(logits: Array, top_k: Array) -> Array:
    vocab = logits.shape[-1]
    on = (top_k > 0) & (top_k < vocab)
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(descending, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    return jnp.where(on[:, None] & (logits < kth), -jnp.inf, logits)


def _rows_top_p(logits: Array, top_p: Array) -> Array:
    cut = _top_p_removes(logits, top_p[:, None])
    return jnp.where((top_p < 1.0)[:, None] & cut, -jnp.inf, logits)


def _rows_min_p(logits: Array, min_p: Array) -> Array:
    cut = _min_p_removes(logits, min_p[:, None])
    return jnp.where((min_p > 0.0)[:, None] & cut, -jnp.inf, logits)


def _when_any(on: Array, rule: Any, logits: Array, setting: Array) -> Array:
    """`rule(logits, setting)` if any row has the rule on, else `logits` (no sort for nothing)."""
    return jax.lax.cond(jnp.any(on), rule, lambda x, _: x, logits, setting)


def filter_rows(
    logits: Float[Array, "B vocab"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    min_p: Float[Array, " B"],
) -> Float[Array, "B vocab"]:
    """`filter_logits` with each row's own settings, arrays: `temperature` (`0` counts as 1),
    `top_k` (`0` for off), `top_p` (`1` for off), `min_p` (`0` for off). A row's result is
    `filter_logits` of that row with its settings, bit for bit."""
    logits = logits.astype(jnp.float32)
    t = temperature.astype(jnp.float32)[:, None]
    logits = jnp.where(t > 0, logits / jnp.where(t > 0, t, 1.0), logits)
    vocab = logits.shape[-1]
    logits = _when_any((top_k > 0) & (top_k < vocab), _rows_top_k, logits, top_k)
    logits = _when_any(top_p < 1.0, _rows_top_p, logits, top_p.astype(jnp.float32))
    return _when_any(min_p > 0.0, _rows_min_p, logits, min_p.astype(jnp.float32))


def draw_rows(
    logits: Float[Array, "B vocab"],
    keys: Array,
    positions: Int[Array, " B"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    min_p: Float[Array, " B"],
) -> Int[Array, " B"]:
    """The next token of each row with its own rules (`filter_rows`) and its own key: row `b`
    drawn with `fold_in(keys[b], positions[b])` (`keys (B, 2)` uint32 key data), greedy where
    its temperature is 0. `draw_tokens` with one key is this with `keys[b] = fold_in(key,
    rows[b])`: the same tokens."""

    def draw(row_logits: Array, key: Array, position: Array) -> Array:
        return jax.random.categorical(jax.random.fold_in(key, position), row_logits, axis=-1)

    def sampled(logits: Array) -> Array:
        kept = filter_rows(logits, temperature, top_k, top_p, min_p)
        drawn = jax.vmap(draw)(kept, keys, positions).astype(jnp.int32)
        return jnp.where(temperature == 0, greedy(logits), drawn)

    # a batch of greedy rows only (the common case) skips the filters and the draws
    return jax.lax.cond(jnp.any(temperature > 0), sampled, greedy, logits)


def score_rows(
    logits: Float[Array, "B vocab"], chosen: Int[Array, " B"], wanted: Array, top: int
) -> tuple[Float[Array, " B"], Int[Array, "B {top}"], Float[Array, "B {top}"]]:
    """Each row's log-probabilities under the model (`log_softmax` of the raw `logits`, before
    any sampling rule, in float32): that of its `chosen` token, and its `top` most likely tokens
    with theirs, most likely first (ties: the lower id first). Computed only when a row is
    `wanted` (zeros otherwise: no pass over the vocabulary for nothing)."""
    rows = logits.shape[0]

    def scored(logits: Array) -> tuple[Array, Array, Array]:
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        own = jnp.take_along_axis(logprobs, chosen[:, None], axis=-1, mode="clip")[:, 0]
        values, ids = jax.lax.top_k(logprobs, top)
        return own, ids.astype(jnp.int32), values

    def nothing(logits: Array) -> tuple[Array, Array, Array]:
        zeros = jnp.zeros((rows, top), jnp.float32)
        return jnp.zeros((rows,), jnp.float32), zeros.astype(jnp.int32), zeros

    return jax.lax.cond(jnp.any(wanted), scored, nothing, logits)
