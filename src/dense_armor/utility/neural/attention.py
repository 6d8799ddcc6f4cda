"""Scaled dot-product attention and the two attention layers, self- and cross-attention
(Vaswani et al. 2017, "Attention Is All You Need").

The blocks built on them live in `blocks`, the positional encodings in `positions`; the names the
attention page imports from here (`TransformerBlock`, `sinusoidal_positions`, ...) are re-exported.
"""

import math
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .blocked import blocked_attention, use_blocked
from .cache import Counter, FixedKVCache, KVCache, RingKVCache, validate_overflow_mode
from .core import (
    CannotStream,
    Layer,
    Param,
    ShapeError,
    python_scalar,
    require_bool,
    require_key,
    require_positive,
    shape_checked,
    type_checked,
)

__all__ = [
    "ContextCache",
    "DecoderCache",
    "Gate",
    "MultiHeadCrossAttention",
    "MultiHeadSelfAttention",
    "TransformerBlock",
    "TransformerDecoderBlock",
    "attention_weights",
    "scaled_dot_product_attention",
    "sinusoidal_encoding",
    "sinusoidal_positions",
]


def attention_weights(
    q: Float[Array, "*#batch T d_k"],
    k: Float[Array, "*#batch S d_k"],
    mask: Bool[Array, "..."] | None = None,
) -> Float[Array, "*#batch T S"]:
    """The weights `softmax(q k^T / sqrt(d_k))` of `scaled_dot_product_attention`, in float32.

    Same arguments as `scaled_dot_product_attention`; every row sums to 1, or is all zeros where
    the mask hides every key.
    """
    scores = jnp.einsum("...td,...sd->...ts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    try:
        mask = jnp.broadcast_to(mask, scores.shape)
    except ValueError:
        raise ShapeError(
            f"scaled_dot_product_attention: received `mask.shape={mask.shape}`; expected a "
            f"shape that broadcasts to the scores' `(..., T, S)={scores.shape}`."
        ) from None
    scores = jnp.where(mask, scores, -jnp.inf)
    # A row that sees no key would be all -inf, and its softmax NaN: its scores are replaced by
    # zeros before the softmax and its weights by zeros after, so its output is 0 and no NaN
    # reaches the gradient. jax.nn.softmax's own derivative (y * (g - sum(y g))) then runs the
    # backward in one pass, twice as fast on a CPU as differentiating the softmax written out.
    seen = mask.any(axis=-1, keepdims=True)
    weights = jax.nn.softmax(jnp.where(seen, scores, 0.0), axis=-1)
    return jnp.where(seen, weights, 0.0)


@type_checked
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
    gradient. A masked key contributes nothing, its value included: a NaN or infinite value that a
    query may not see leaves that query's output as it would be without it, and a query that sees
    one gets NaN in its whole row.
    """
    weights = attention_weights(q, k, mask)
    # A masked weight is exactly 0, but 0 * NaN is NaN: zero the non-finite values, then mark the
    # queries that may see one (the same rule as blocked_attention's).
    finite = jnp.isfinite(v).all(axis=-1)
    clean = jnp.where(finite[..., None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("...ts,...sd->...td", weights.astype(v.dtype), clean)
    bad = jnp.broadcast_to(jnp.expand_dims(~finite, -2), weights.shape)
    if mask is not None:
        bad = bad & jnp.broadcast_to(mask, weights.shape)
    return jnp.where(bad.any(axis=-1)[..., None], jnp.asarray(jnp.nan, out.dtype), out)


def _check_heads(d_model: int, n_heads: int) -> None:
    require_positive(d_model=d_model, n_heads=n_heads)
    if d_model % n_heads:
        raise ValueError(
            f"`d_model` must be divisible by `n_heads`; received `d_model={d_model}`, "
            f"`n_heads={n_heads}` (remainder {d_model % n_heads})."
        )


def _project(x: Array, weight: Param) -> Array:
    """`x @ weight`, in the dtype of `x`."""
    return jnp.einsum("...d,de->...e", x, weight.value.astype(x.dtype))


def _attend_heads(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    x: Array,
    keys: Array,
    values: Array,
    mask: Array | None,
) -> Array:
    """Queries `x W_Q` of `x (T, d_model)`, split into heads, against projected `keys` and
    `values` already in heads `(n_heads, S, d_head)`; attended with
    `scaled_dot_product_attention` and joined by `W_O`."""
    q = _heads(_project(x, layer.W_Q), layer.n_heads)
    # Cached keys and values may be stored wider than the compute dtype (float32 under bfloat16).
    out = scaled_dot_product_attention(q, keys.astype(x.dtype), values.astype(x.dtype), mask)
    return _join_heads(layer, out)


def _join_heads(layer: "MultiHeadSelfAttention | MultiHeadCrossAttention", out: Array) -> Array:
    """Heads `(n_heads, T, d_head)` joined to `(T, d_model)` and projected by `W_O`."""
    joined = out.transpose(1, 0, 2).reshape(out.shape[1], layer.d_model)
    return _project(joined, layer.W_O)


def _sequence_mask(
    queries: int, keys: int, causal: bool, window: int | None, key_mask: Array | None
) -> Array | None:
    """The `(T, S)` mask (or `None`) that `causal`, `window` and `key_mask (S,)` describe."""
    mask = None
    if causal:
        rows, cols = jnp.arange(queries)[:, None], jnp.arange(keys)[None, :]
        mask = cols <= rows
        if window is not None:
            mask = mask & (cols > rows - window)
    if key_mask is not None:
        mask = key_mask[None, :] if mask is None else mask & key_mask[None, :]
    return mask


def _attend_sequence(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    x: Array,
    keys: Array,
    values: Array,
    key_mask: Array | None,
    causal: bool = False,
    window: int | None = None,
) -> Array:
    """Every row of `x (T, d_model)` against projected `keys` and `values` `(S, d_model)`, under
    the mask that `causal`, `window` and `key_mask (S,)` describe: with `blocked_attention` (the
    mask never materialised) or the materialised scores, as `layer.memory_efficient` and the
    lengths decide."""
    length, key_length = x.shape[0], keys.shape[0]
    if not use_blocked(layer.memory_efficient, length, key_length):
        mask = _sequence_mask(length, key_length, causal, window, key_mask)
        return _attend_flat(layer, x, keys, values, mask)
    q = _heads(_project(x, layer.W_Q), layer.n_heads)
    keys, values = _heads(keys, layer.n_heads), _heads(values, layer.n_heads)
    keys, values = keys.astype(x.dtype), values.astype(x.dtype)
    out = blocked_attention(q, keys, values, causal=causal, window=window, key_mask=key_mask)
    return _join_heads(layer, out)


def _attend_flat(
    layer: "MultiHeadSelfAttention | MultiHeadCrossAttention",
    x: Array,
    keys: Array,
    values: Array,
    mask: Array | None,
) -> Array:
    """`_attend_heads` with keys and values `(S, d_model)`, split into heads first."""
    keys, values = _heads(keys, layer.n_heads), _heads(values, layer.n_heads)
    return _attend_heads(layer, x, keys, values, mask)


def _heads(a: Array, n_heads: int) -> Array:
    """`(L, d_model) -> (n_heads, L, d_model / n_heads)`."""
    return a.reshape(a.shape[0], n_heads, a.shape[1] // n_heads).transpose(1, 0, 2)


def _check_window(window: int | None, causal: bool) -> None:
    if window is None:
        return
    require_positive(window=window)
    if not causal:
        raise ValueError(
            f"`window={window}` restricts each step to the last `window` steps, which needs "
            "`causal=True`."
        )


def _check_memory_efficient(memory_efficient: bool | None) -> None:
    if memory_efficient is not None and not isinstance(memory_efficient, bool):
        raise ValueError(
            "`memory_efficient` must be True, False or None (blocked attention from "
            f"`BLOCKED_MIN_LENGTH` steps on); received `memory_efficient={memory_efficient!r}`."
        )


def _require_causal(layer: "MultiHeadSelfAttention | TransformerBlock") -> None:
    if not layer.causal:
        raise CannotStream(
            f"{type(layer).__name__} was built with `causal=False`: step t of it would see later "
            "steps, so it cannot stream. Build it with `causal=True`."
        )


class MultiHeadSelfAttention(Layer):
    """Multi-head self-attention with the four projections `W_Q`, `W_K`, `W_V`, `W_O` and no biases
    (Vaswani et al. 2017, page 5).

    **Arguments:** `d_model` (the width, divisible by `n_heads`), `n_heads`, `key`,
    `causal=False` (step t looks only at steps up to t; masked scores are `-inf`), `window=None`
    (with `causal=True`: step t looks only at the last `window` steps, `t - window < s <= t`),
    `memory_efficient=None` (`True`: `forward` attends with `blocked_attention`, in memory linear
    in T; `False`: with the `(T, T)` scores materialised; `None`: blocked from
    `BLOCKED_MIN_LENGTH` steps on). Both give the same result up to float32 round-off.

    `forward(x, mask=None)` maps `(T, d_model) -> (T, d_model)`; `mask (T,)` marks the valid
    steps of a padded sequence (padding at the end), whose keys are then hidden.
    `params()` is `[W_Q, W_K, W_V, W_O]`, each `(d_model, d_model)`, initialised uniform in
    `[-1/sqrt(d_model), 1/sqrt(d_model)]`. `attention_weights(x)` returns the weights
    `(n_heads, T, T)`.

    A causal layer streams: `cache = m.init_cache()` (growing, two `(0, d_model)` arrays) or
    `m.init_cache(capacity)` (fixed), then `y_t, cache = m.step(x_t, cache)`. A windowed layer's
    cache is a ring of `window` rows whatever the capacity: it never overflows.
    """

    W_Q: Param
    W_K: Param
    W_V: Param
    W_O: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)
    n_heads: int = eqx.field(static=True, converter=python_scalar)
    causal: bool = eqx.field(static=True, converter=python_scalar)
    window: int | None = eqx.field(static=True, converter=python_scalar)
    memory_efficient: bool | None = eqx.field(static=True, converter=python_scalar)
    accepts_mask: ClassVar[bool] = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        key: PRNGKeyArray,
        causal: bool = False,
        window: int | None = None,
        memory_efficient: bool | None = None,
    ):
        require_key(key)
        _check_heads(d_model, n_heads)
        require_bool(causal=causal)
        _check_window(window, causal)
        _check_memory_efficient(memory_efficient)
        bound = 1.0 / math.sqrt(d_model)
        qkey, kkey, vkey, okey = jr.split(key, 4)

        def init(k: PRNGKeyArray) -> Param:
            return Param(jr.uniform(k, (d_model, d_model), minval=-bound, maxval=bound))

        self.W_Q, self.W_K, self.W_V, self.W_O = init(qkey), init(kkey), init(vkey), init(okey)
        self.d_model = d_model
        self.n_heads = n_heads
        self.causal = causal
        self.window = window
        self.memory_efficient = memory_efficient

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def _cache_shape(self, rows: int) -> tuple[int, int, int]:
        """A fixed or ring cache's buffers: per head, `(n_heads, rows, d_head)`, so a step reads
        each head's keys contiguously with no transpose."""
        return (self.n_heads, rows, self.d_head)

    def _keys_values(self, x: Array) -> tuple[Array, Array]:
        return _project(x, self.W_K), _project(x, self.W_V)

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T d_model"],
        *,
        mask: Bool[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_model"]:
        keys, values = self._keys_values(x)
        return _attend_sequence(self, x, keys, values, mask, self.causal, self.window)

    @shape_checked
    def attention_weights(
        self, x: Float[Array, "T d_model"], *, mask: Bool[Array, " T"] | None = None
    ) -> Float[Array, "n_heads T T"]:
        """The attention weights of `forward(x, mask=mask)`, `(n_heads, T, T)`, in float32."""
        q = _heads(_project(x, self.W_Q), self.n_heads)
        k = _heads(_project(x, self.W_K), self.n_heads)
        length = x.shape[0]
        return attention_weights(
            q, k, _sequence_mask(length, length, self.causal, self.window, mask)
        )

    def init_cache(
        self, capacity: int | None = None, *, on_overflow: str = "raise"
    ) -> KVCache | FixedKVCache | RingKVCache:
        """An empty cache: growing (`capacity=None`, two `(0, d_model)` arrays) or fixed.

        A fixed cache holds `capacity` steps; `on_overflow` (`"raise"` or `"nan"`) says what a
        step past that does (see `dense_armor.utility.neural.cache`). A windowed layer ignores
        `capacity`: its cache is a ring of `window` rows that never overflows.
        """
        _require_causal(self)
        validate_overflow_mode(on_overflow)
        # Keys and values get buffers of their own, so that both can be donated.
        if self.window is not None:
            zeros = self._cache_shape(self.window)
            return RingKVCache(jnp.zeros(zeros), jnp.zeros(zeros), jnp.zeros((), jnp.int32))
        if capacity is None:
            return KVCache(jnp.zeros((0, self.d_model)), jnp.zeros((0, self.d_model)))
        require_positive(capacity=capacity)
        zeros = self._cache_shape(capacity)
        return FixedKVCache(
            keys=jnp.zeros(zeros), values=jnp.zeros(zeros), counter=Counter.start(on_overflow)
        )

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: KVCache | FixedKVCache | RingKVCache
    ) -> tuple[Float[Array, "K d_model"], KVCache | FixedKVCache | RingKVCache]:
        """`K` causal steps at once: the chunk's keys and values go into `cache` (the cache owns
        the write: `cache.update`), and each row attends to what its step may see.

        **Returns:** `(y, cache)`, `y (K, d_model)`: what `K` calls of `step` return, stacked, to
        float32 round-off. A fixed cache with too little room applies its overflow rule to the
        rows past its capacity, as `step` would.
        """
        _require_causal(self)
        keys, values = (_heads(_project(x, w), self.n_heads) for w in (self.W_K, self.W_V))
        update = cache.update(keys, values, self.window)
        y = _attend_heads(self, x, update.keys, update.values, update.visible)
        return update.cache.guard(y, update.fits), update.cache

    @shape_checked
    def step(
        self, x_t: Float[Array, " d_model"], cache: KVCache | FixedKVCache | RingKVCache
    ) -> tuple[Float[Array, " d_model"], KVCache | FixedKVCache | RingKVCache]:
        """One causal step: append `x_t`'s key and value to `cache`, attend over the cache.

        **Returns:** `(y_t, cache)`, `y_t` of shape `(d_model,)`: after `t+1` steps, row `t` of
        `forward` on those steps.
        """
        y, cache = self.prefill(x_t[None], cache)
        return y[0], cache


class ContextCache(NamedTuple):
    """A context's projected keys and values, `(S, d_model)` each, and its mask `(S,)`."""

    keys: Float[Array, "S d_model"]
    values: Float[Array, "S d_model"]
    mask: Bool[Array, " S"]


class MultiHeadCrossAttention(Layer):
    """Multi-head attention from one sequence to another: queries from `x (T, d_model)`, keys and
    values from a context `(S, d_context)` (Vaswani et al. 2017, page 5, "encoder-decoder
    attention"). Four projections, no biases: `W_Q (d_model, d_model)`, `W_K` and `W_V`
    `(d_context, d_model)`, `W_O (d_model, d_model)`.

    **Arguments:** `d_model` (divisible by `n_heads`), `n_heads`, `key`, `d_context=None` (the
    context's width; default `d_model`), `memory_efficient=None` (`forward` with
    `blocked_attention`: `True`, `False`, or `None` for when `T * S >= BLOCKED_MIN_LENGTH ** 2`).

    `forward(x, context, context_mask=None)`: `context_mask (S,)` is `True` on the context steps to
    look at (padding is `False`); a query with no visible step gets zeros, never NaN.
    Streaming: `cache = layer.init_cache(context)` projects the context once; `step(x_t, cache)`
    then costs one query.
    """

    W_Q: Param
    W_K: Param
    W_V: Param
    W_O: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)
    n_heads: int = eqx.field(static=True, converter=python_scalar)
    d_context: int = eqx.field(static=True, converter=python_scalar)
    memory_efficient: bool | None = eqx.field(static=True, converter=python_scalar)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        key: PRNGKeyArray,
        d_context: int | None = None,
        memory_efficient: bool | None = None,
    ):
        require_key(key)
        _check_heads(d_model, n_heads)
        _check_memory_efficient(memory_efficient)
        d_context = d_model if d_context is None else d_context
        require_positive(d_context=d_context)
        qkey, kkey, vkey, okey = jr.split(key, 4)

        def init(k: PRNGKeyArray, d_in: int) -> Param:
            bound = 1.0 / math.sqrt(d_in)
            return Param(jr.uniform(k, (d_in, d_model), minval=-bound, maxval=bound))

        self.W_Q, self.W_K = init(qkey, d_model), init(kkey, d_context)
        self.W_V, self.W_O = init(vkey, d_context), init(okey, d_model)
        self.d_model, self.n_heads, self.d_context = d_model, n_heads, d_context
        self.memory_efficient = memory_efficient

    @shape_checked
    def init_cache(
        self, context: Float[Array, "S d_context"], *, context_mask: Bool[Array, " S"] | None = None
    ) -> ContextCache:
        """Project the context's keys and values once, for `step`."""
        mask = jnp.ones(context.shape[0], bool) if context_mask is None else context_mask
        return ContextCache(_project(context, self.W_K), _project(context, self.W_V), mask)

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T d_model"],
        context: Float[Array, "S d_context"],
        *,
        context_mask: Bool[Array, " S"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_model"]:
        return self.step_sequence(x, self.init_cache(context, context_mask=context_mask))

    def step_sequence(self, x: Array, cache: ContextCache) -> Array:
        """Attend from every row of `x (T, d_model)` to a projected context."""
        return _attend_sequence(self, x, cache.keys, cache.values, cache.mask)

    @shape_checked
    def step(
        self, x_t: Float[Array, " d_model"], cache: ContextCache
    ) -> tuple[Float[Array, " d_model"], ContextCache]:
        """One query against the cached context; the cache comes back unchanged."""
        if cache.keys.ndim != 2 or cache.keys.shape[1] != self.d_model:
            raise ShapeError(
                f"MultiHeadCrossAttention.step: received `cache.keys.shape={cache.keys.shape}`; "
                f"expected `(S, d_model={self.d_model})`. Use `init_cache(context)`."
            )
        return self.step_sequence(x_t[None], cache)[0], cache

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: ContextCache
    ) -> tuple[Float[Array, "K d_model"], ContextCache]:
        """`K` queries against the cached context at once; the cache comes back unchanged."""
        return self.step_sequence(x, cache), cache


# The names the attention page imports from this module, defined where their concern lives.
from .blocks import DecoderCache, Gate, TransformerBlock, TransformerDecoderBlock  # noqa: E402
from .positions import sinusoidal_encoding, sinusoidal_positions  # noqa: E402
