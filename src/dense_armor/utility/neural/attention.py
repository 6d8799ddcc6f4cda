"""Scaled dot-product attention, multi-head self-attention, the Transformer block, and the
sinusoidal positional encoding (Vaswani et al. 2017, "Attention Is All You Need").
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, jaxtyped

from .cache import (
    FixedKVCache,
    KVCache,
    guard_overflow,
    start_index,
    validate_overflow_mode,
)
from .core import Layer, Param, ShapeError, require_positive, shape_checked
from .layers import Dropout, FeedForward, LayerNorm

__all__ = [
    "MultiHeadSelfAttention",
    "TransformerBlock",
    "scaled_dot_product_attention",
    "sinusoidal_encoding",
    "sinusoidal_positions",
]


@jaxtyped(typechecker=beartype)
def scaled_dot_product_attention(
    q: Float[Array, "*#batch T d_k"],
    k: Float[Array, "*#batch S d_k"],
    v: Float[Array, "*#batch S d_v"],
    mask: Bool[Array, "..."] | None = None,
) -> Float[Array, "*#batch T d_v"]:
    """`softmax(q k^T / sqrt(d_k)) v` (Vaswani et al. 2017, Eq.(1), page 4).

    **Arguments:**

    - `q`: queries, `(..., T, d_k)`; `k`: keys, `(..., S, d_k)`; `v`: values, `(..., S, d_v)`.
      Leading (head, batch) axes broadcast against each other.
    - `mask`: optional boolean array broadcastable to the scores `(..., T, S)`; `True` where a
      query may look at a key. Masked scores are set to `-inf` before the softmax.

    **Returns:** `(..., T, d_v)`, in the dtype of `v`. The softmax runs in float32 whatever the
    input dtype. A query whose every key is masked gets zeros (never NaN), in the output and in the
    gradient.
    """
    scores = jnp.einsum("...td,...sd->...ts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    if mask is not None:
        try:
            mask = jnp.broadcast_to(mask, scores.shape)
        except ValueError:
            raise ShapeError(
                f"scaled_dot_product_attention: received `mask.shape={mask.shape}`; expected a "
                f"shape that broadcasts to the scores' `(..., T, S)={scores.shape}`."
            ) from None
        scores = jnp.where(mask, scores, -jnp.inf)
    # The row maximum keeps exp() in range; a fully masked row has max -inf, replaced by 0 so the
    # row becomes exp(-inf) = 0 everywhere and its weights 0 / 1 = 0, with no NaN in the gradient.
    row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalised = jnp.exp(scores - row_max)
    total = unnormalised.sum(axis=-1, keepdims=True)
    weights = unnormalised / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("...ts,...sd->...td", weights.astype(v.dtype), v)


def sinusoidal_encoding(positions: Int[Array, "*P"], d_model: int) -> Float[Array, "*P d_model"]:
    """The sinusoidal encoding of the given integer positions (Vaswani et al. 2017, page 6).

    Column `2i` is `sin(pos / 10000^(2i/d_model))` and column `2i+1` the cosine of the same angle.
    Defined for any position, so a traced step counter works under `jax.jit`.
    """
    require_positive(d_model=d_model)
    half = (d_model + 1) // 2
    frequencies = np.exp(-math.log(10000.0) * 2.0 * np.arange(half) / d_model)
    angles = jnp.tensordot(
        jnp.asarray(positions, jnp.float32), jnp.asarray(frequencies, jnp.float32), axes=0
    )
    pairs = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pairs.reshape(*angles.shape[:-1], 2 * half)[..., :d_model]


def sinusoidal_positions(length: int, d_model: int) -> Float[Array, "length d_model"]:
    """The fixed table of sines and cosines for positions `0 .. length-1`, `(length, d_model)`.

    Row 1 of `sinusoidal_positions(4, 4)` is `[sin(1), cos(1), sin(0.01), cos(0.01)]`.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"`length` must be a non-negative integer; received `length={length!r}`.")
    return sinusoidal_encoding(jnp.arange(length), d_model)


def _check_heads(d_model: int, n_heads: int) -> None:
    require_positive(d_model=d_model, n_heads=n_heads)
    if d_model % n_heads:
        raise ValueError(
            f"`d_model` must be divisible by `n_heads`; received `d_model={d_model}`, "
            f"`n_heads={n_heads}` (remainder {d_model % n_heads})."
        )


def _require_causal(layer: "MultiHeadSelfAttention | TransformerBlock") -> None:
    if not layer.causal:
        raise ValueError(
            f"{type(layer).__name__} was built with `causal=False`: step t of it would see later "
            "steps, so it cannot stream. Build it with `causal=True`."
        )


class MultiHeadSelfAttention(Layer):
    """Multi-head self-attention with the four projections `W_Q`, `W_K`, `W_V`, `W_O` and no biases
    (Vaswani et al. 2017, page 5).

    **Arguments:** `d_model` (the width, divisible by `n_heads`), `n_heads`, `key`,
    `causal=False` (step t looks only at steps up to t; masked scores are `-inf`).

    `forward(x)` maps `(T, d_model) -> (T, d_model)`. `params()` is `[W_Q, W_K, W_V, W_O]`, each
    `(d_model, d_model)`, initialised uniform in `[-1/sqrt(d_model), 1/sqrt(d_model)]`.

    A causal layer streams: `cache = m.init_cache()` (growing, two `(0, d_model)` arrays) or
    `m.init_cache(capacity)` (fixed), then `y_t, cache = m.step(x_t, cache)`.
    """

    W_Q: Param
    W_K: Param
    W_V: Param
    W_O: Param
    d_model: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(self, d_model: int, n_heads: int, key: PRNGKeyArray, causal: bool = False):
        _check_heads(d_model, n_heads)
        bound = 1.0 / math.sqrt(d_model)
        qkey, kkey, vkey, okey = jr.split(key, 4)

        def init(k: PRNGKeyArray) -> Param:
            return Param(jr.uniform(k, (d_model, d_model), minval=-bound, maxval=bound))

        self.W_Q, self.W_K, self.W_V, self.W_O = init(qkey), init(kkey), init(vkey), init(okey)
        self.d_model = d_model
        self.n_heads = n_heads
        self.causal = causal

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def _project(self, x: Array, weight: Param) -> Array:
        """`(..., d_model) @ (d_model, d_model)`, split into heads: `(n_heads, ..., d_head)`."""
        y = jnp.einsum("...d,de->...e", x, weight.value.astype(x.dtype))
        y = y.reshape(*x.shape[:-1], self.n_heads, self.d_head)
        return jnp.moveaxis(y, -2, 0)

    def _attend(
        self, x: Array, keys: Array, values: Array, mask: Array | None
    ) -> Float[Array, "T d_model"]:
        """Queries from `x (T, d_model)` against projected `keys`, `values` `(S, d_model)`."""
        q = self._project(x, self.W_Q)
        k = keys.reshape(-1, self.n_heads, self.d_head).transpose(1, 0, 2)
        v = values.reshape(-1, self.n_heads, self.d_head).transpose(1, 0, 2)
        heads = scaled_dot_product_attention(q, k, v, mask)  # (n_heads, T, d_head)
        joined = heads.transpose(1, 0, 2).reshape(x.shape[0], self.d_model)
        return jnp.einsum("td,de->te", joined, self.W_O.value.astype(x.dtype))

    def _keys_values(self, x: Array) -> tuple[Array, Array]:
        return x @ self.W_K.value.astype(x.dtype), x @ self.W_V.value.astype(x.dtype)

    @shape_checked
    def forward(
        self, x: Float[Array, "T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "T d_model"]:
        keys, values = self._keys_values(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool)) if self.causal else None
        return self._attend(x, keys, values, mask)

    def init_cache(
        self, capacity: int | None = None, *, on_overflow: str = "raise"
    ) -> KVCache | FixedKVCache:
        """An empty cache: growing (`capacity=None`, two `(0, d_model)` arrays) or fixed.

        A fixed cache holds `capacity` steps; `on_overflow` (`"raise"` or `"nan"`) says what a
        step past that does (see `dense_armor.utility.neural.cache`).
        """
        _require_causal(self)
        validate_overflow_mode(on_overflow)
        # Keys and values get buffers of their own, so that both can be donated.
        if capacity is None:
            return KVCache(jnp.zeros((0, self.d_model)), jnp.zeros((0, self.d_model)))
        require_positive(capacity=capacity)
        keys, values = jnp.zeros((capacity, self.d_model)), jnp.zeros((capacity, self.d_model))
        return FixedKVCache(keys, values, *start_index(), on_overflow=on_overflow)

    @shape_checked
    def step(
        self, x_t: Float[Array, " d_model"], cache: KVCache | FixedKVCache
    ) -> tuple[Float[Array, " d_model"], KVCache | FixedKVCache]:
        """One causal step: append `x_t`'s key and value to `cache`, attend over the cache.

        **Returns:** `(y_t, cache)`, `y_t` of shape `(d_model,)`: after `t+1` steps, row `t` of
        `forward` on those steps.
        """
        _require_causal(self)
        k_t, v_t = self._keys_values(x_t)
        if isinstance(cache, KVCache):
            if cache.keys.ndim != 2 or cache.keys.shape[1] != self.d_model:
                raise ShapeError(
                    f"MultiHeadSelfAttention.step: received `cache.keys.shape={cache.keys.shape}`;"
                    f" expected `(t, d_model={self.d_model})`. Use `init_cache()`."
                )
            keys = jnp.concatenate([cache.keys, k_t[None].astype(cache.keys.dtype)])
            values = jnp.concatenate([cache.values, v_t[None].astype(cache.values.dtype)])
            y = self._attend(x_t[None], keys, values, None)[0]
            return y, KVCache(keys, values)
        capacity = cache.capacity
        if cache.keys.shape[1:] != (self.d_model,):
            raise ShapeError(
                f"MultiHeadSelfAttention.step: received `cache.keys.shape={cache.keys.shape}`; "
                f"expected `(capacity, d_model={self.d_model})`. Use `init_cache(capacity)`."
            )
        full = cache.index >= capacity
        slot = jnp.minimum(cache.index, capacity - 1)
        # XLA clamps an out-of-range slice start; a full cache rewrites its last row unchanged.
        k_row = jnp.where(full, cache.keys[slot], k_t.astype(cache.keys.dtype))
        v_row = jnp.where(full, cache.values[slot], v_t.astype(cache.values.dtype))
        keys = jax.lax.dynamic_update_slice(cache.keys, k_row[None], (slot, 0))
        values = jax.lax.dynamic_update_slice(cache.values, v_row[None], (slot, 0))
        visible = (jnp.arange(capacity) <= cache.index)[None, :]
        y = self._attend(x_t[None], keys, values, visible)[0]
        y = guard_overflow(
            y, full, cache.on_overflow, f"the key/value cache is full (capacity {capacity})"
        )
        new = FixedKVCache(
            keys,
            values,
            cache.index + jnp.where(full, 0, 1).astype(cache.index.dtype),
            cache.overflow | full,
            on_overflow=cache.on_overflow,
        )
        return y, new


class TransformerBlock(Layer):
    """The post-LayerNorm Transformer block (Vaswani et al. 2017, page 3 and Eq.(2), page 5).

    `y = LayerNorm(x + Dropout(Attention(x)))`, then `z = LayerNorm(y + Dropout(FFN(y)))`.

    **Arguments:** `d_model`, `n_heads`, `d_ff` (the hidden width of the feed-forward), `key`,
    `causal=False`, `dropout=0.0` (applied to each sub-layer's output before the residual
    addition, only when `forward` gets a `key`).

    `params()` is, in order, the attention's `[W_Q, W_K, W_V, W_O]`, the first LayerNorm's
    `[gain, bias]`, the feed-forward's `[W_1, b_1, W_2, b_2]` and the second LayerNorm's
    `[gain, bias]`: 12 in all. A causal block streams like `MultiHeadSelfAttention`.
    """

    attention: MultiHeadSelfAttention
    norm1: LayerNorm
    feed_forward: FeedForward
    norm2: LayerNorm
    dropout: Dropout
    d_model: int = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        key: PRNGKeyArray,
        causal: bool = False,
        dropout: float = 0.0,
    ):
        _check_heads(d_model, n_heads)
        require_positive(d_ff=d_ff)
        akey, fkey = jr.split(key)
        self.attention = MultiHeadSelfAttention(d_model, n_heads, akey, causal=causal)
        self.norm1 = LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, d_ff, fkey)
        self.norm2 = LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.d_model = d_model

    @property
    def causal(self) -> bool:
        return self.attention.causal

    @shape_checked
    def forward(
        self, x: Float[Array, "T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "T d_model"]:
        akey, fkey = (None, None) if key is None else jr.split(key)
        y = self.norm1(x + self.dropout(self.attention(x), key=akey))
        return self.norm2(y + self.dropout(self.feed_forward(y), key=fkey))

    def init_cache(
        self, capacity: int | None = None, *, on_overflow: str = "raise"
    ) -> KVCache | FixedKVCache:
        """The attention's cache (see `MultiHeadSelfAttention.init_cache`)."""
        return self.attention.init_cache(capacity, on_overflow=on_overflow)

    @shape_checked
    def step(
        self, x_t: Float[Array, " d_model"], cache: KVCache | FixedKVCache
    ) -> tuple[Float[Array, " d_model"], KVCache | FixedKVCache]:
        """One causal step of the block; see `MultiHeadSelfAttention.step`."""
        a_t, cache = self.attention.step(x_t, cache)
        y_t = self.norm1(x_t + a_t)
        return self.norm2(y_t + self.feed_forward(y_t)), cache
