"""Multi-head self-attention (Vaswani et al. 2017, page 5), which streams through a key/value
cache that owns its writes (`cache.update`)."""

import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import (
    Param,
    called_as,
    python_scalar,
    require_bool,
    require_key,
    require_positive,
    require_rate,
    shape_checked,
)
from ..kernels import blocked as blocked
from ..kernels.choice import choose_kernel, resolve_implementation
from ..kernels.rotary import Rotary, check_rope_scaling
from ..layers.language import RMSNorm
from ..state.cache import FixedKVCache, KVCache, RingKVCache
from ..state.counter import Counter, validate_overflow_mode
from ..state.paged import PagedKVCache
from .heads import (
    MultiHeadAttention,
    _check_heads,
    _check_window,
    _heads,
    _require_causal,
    _sequence_mask,
)

__all__ = ["MultiHeadSelfAttention"]

# The caches a self-attention streams through (`init_cache`'s three kinds).
Cache = KVCache | FixedKVCache | RingKVCache | PagedKVCache


def _check_rope(rope_base: float | None, d_head: int, fraction: float = 1.0) -> None:
    if rope_base is None:
        return
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, numbers.Real)
        or not 0 < fraction <= 1
    ):
        raise ValueError(
            f"`rotary_fraction` must be a number in (0, 1] (the share of each head's features "
            f"that rotate); received `rotary_fraction={fraction!r}`."
        )
    real = isinstance(rope_base, numbers.Real) and not isinstance(rope_base, bool | np.bool_)
    if not real or not math.isfinite(rope_base) or rope_base <= 1:
        raise ValueError(
            f"`rope_base` must be a finite number above 1 (10000 in RoFormer), or None for no "
            f"rotary positions; received `rope_base={rope_base!r}`."
        )
    if int(d_head * fraction) % 2 or int(d_head * fraction) == 0:
        raise ValueError(
            f"rotary positions rotate pairs of features: `d_model / n_heads` (or `head_dim`) "
            f"times `rotary_fraction` must be even and positive; it is "
            f"{int(d_head * fraction)}."
        )


def _check_longrope(
    scaling: tuple | None, rope_base: float | None, d_head: int, fraction: float, window: Any
) -> None:
    """LongRoPE's factor lists, one entry per rotated pair, and no window (a window's positions
    never end, LongRoPE's end at the pretrained length)."""
    if scaling is None or dict(scaling)["rope_type"] != "longrope":
        return
    if rope_base is None:
        raise ValueError("`rope_scaling` scales rotary positions: give `rope_base` too.")
    if window is not None:
        raise ValueError(
            "`rope_scaling` of type 'longrope' with a `window` is not built: a window streams "
            "without end, and LongRoPE's positions end at its pretrained length."
        )
    rotary = Rotary(float(rope_base), d_head, float(fraction), scaling)
    rotary.frequencies()  # each list's length


QK_NORMS = (None, "head", "projection")


def _softcap_implementation(implementation: str) -> str:
    """Soft-capped scores are computed by the materialised kernel alone (the blocked one and
    `jax.nn.dot_product_attention` have no cap): `"auto"` becomes `"materialised"`."""
    if implementation not in ("auto", "materialised"):
        raise ValueError(
            f"`logit_softcap` caps the materialised scores; `implementation={implementation!r}` "
            "has no cap. Leave `implementation` unset or pass 'materialised'."
        )
    return "materialised"


def _check_number(name: str, value: Any) -> float | None:
    """A positive finite number, or `None`."""
    if value is None:
        return None
    real = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if not real or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive finite number or None; received {value!r}.")
    return float(value)


def _qk_norms(
    qk_norm: str | None, n_heads: int, n_kv_heads: int, d_head: int, eps: float, plus_one: bool
) -> tuple[RMSNorm | None, RMSNorm | None]:
    """The query and key RMSNorms that `qk_norm` asks for (`None`, `"head"`: over each head's
    features, one gain shared by the heads; `"projection"`: over the whole projection)."""
    require_bool(qk_norm_plus_one=plus_one)
    if qk_norm not in QK_NORMS:
        raise ValueError(f"`qk_norm` must be one of {QK_NORMS}; received `qk_norm={qk_norm!r}`.")
    if qk_norm is None:
        return None, None
    widths = (d_head, d_head) if qk_norm == "head" else (n_heads * d_head, n_kv_heads * d_head)
    return tuple(RMSNorm(w, eps, plus_one=plus_one) for w in widths)  # type: ignore[return-value]


class MultiHeadSelfAttention(MultiHeadAttention):
    """Multi-head self-attention with the four projections `W_Q`, `W_K`, `W_V`, `W_O` and no biases
    (Vaswani et al. 2017, page 5).

    **Arguments:** `d_model` (the width, divisible by `n_heads`), `n_heads`, `key`,
    `causal=False` (step t looks only at steps up to t; masked scores are `-inf`), `window=None`
    (with `causal=True`: step t looks only at the last `window` steps, `t - window < s <= t`),
    `implementation=None`, how the scores are computed: `"auto"` (the default: materialised below
    `BLOCKED_MIN_LENGTH` steps, `blocked_attention` from there on, in memory linear in T),
    `"materialised"` (the `(T, T)` scores), `"blocked"`, or `jax.nn.dot_product_attention`'s
    `"xla"` or `"cudnn"` (cuDNN's fused kernel, on an NVIDIA GPU; an export lowers it as
    `"xla"`, since jax.export does not accept its custom call). `memory_efficient=None` is the
    older spelling (`True`: `"blocked"`, `False`: `"materialised"`). All give the same result up
    to float32 round-off.

    `n_kv_heads=None` (grouped-query attention: keys and values in `n_kv_heads` heads, each
    shared by a group of `n_heads / n_kv_heads` consecutive query heads, never repeated in memory;
    1 is multi-query; default `n_heads`, plain multi-head attention) and `rope_base=None` (rotary
    positions: queries and keys rotated by their step index inside the attention, features `i`
    and `i + d_head / 2` together by `position * rope_base ** (-2 i / d_head)`, as in Llama and
    Equinox's `RotaryPositionalEmbedding`; a stream takes the positions from its cache, and only
    their differences matter, so a windowed stream runs forever), `use_bias=False` (biases
    `b_Q, b_K, b_V, b_O`, started at zero, as PyTorch's `nn.MultiheadAttention` has) and
    `attention_dropout=0.0` (dropout on the attention weights, in `forward` with a `key`; the
    weights are then materialised).

    The options of the checkpoints of 2024-2026: `head_dim=None` (each head's width, apart from
    `d_model / n_heads`: Qwen3's, Gemma's and Mistral-Nemo's), `rope_scaling=None` (a mapping with
    `rope_type` `"linear"`, `"llama3"` or `"yarn"` and that kind's keys, as in a Hugging Face
    config; see `kernels.rotary`), `rotary_fraction=1.0` (only the first fraction of each head's
    features rotate: Phi-3/4's `partial_rotary_factor`), `qk_norm=None` (an RMSNorm on the queries
    and keys before the rotation: `"head"`, over each head's features, Qwen3's and Gemma 3's;
    `"projection"`, over the whole projection, OLMo 2's; `qk_norm_eps=1e-6`,
    `qk_norm_plus_one=False`: Gemma's `1 + w` gain), `query_scale=None` (the scores' scale, apart
    from `d_head ** -0.5`: Gemma's `query_pre_attn_scalar ** -0.5`) and `logit_softcap=None`
    (scores `cap * tanh(s / cap)` before the mask, Gemma 2's `attn_logit_softcapping`) and
    `output_gate=False` (Qwen3.5's: the heads' outputs times `sigmoid(x W_G)` before `W_O`,
    `W_G (d_model, n_heads * d_head)`).

    `forward(x, mask=None)` maps `(T, d_model) -> (T, d_model)`, `mask` the padding mask of
    `Layer`.
    `params()` is `[W_Q, W_K, W_V, W_O]`: `W_Q` and `W_O` `(d_model, d_model)`, `W_K` and `W_V`
    `(d_model, n_kv_heads * d_head)` (`(d_model, d_model)` by default), initialised uniform in
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
    n_kv_heads: int = eqx.field(static=True, converter=python_scalar)
    causal: bool = eqx.field(static=True, converter=python_scalar)  # type: ignore[misc]
    window: int | None = eqx.field(static=True, converter=python_scalar)
    implementation: str = eqx.field(static=True, converter=python_scalar)
    rope_base: float | None = eqx.field(static=True, converter=python_scalar)
    attention_dropout: float = eqx.field(static=True, converter=python_scalar)
    b_Q: Param | None
    b_K: Param | None
    b_V: Param | None
    b_O: Param | None
    head_dim: int = eqx.field(static=True, converter=python_scalar)
    rope_scaling: tuple | None = eqx.field(static=True)
    rotary_fraction: float = eqx.field(static=True, converter=python_scalar)
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    W_G: Param | None
    query_scale: float | None = eqx.field(static=True, converter=python_scalar)
    logit_softcap: float | None = eqx.field(static=True, converter=python_scalar)
    accepts_mask: ClassVar[bool] = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        key: PRNGKeyArray,
        causal: bool = False,
        window: int | None = None,
        memory_efficient: bool | None = None,
        implementation: str | None = None,
        n_kv_heads: int | None = None,
        rope_base: float | None = None,
        use_bias: bool = False,
        attention_dropout: float = 0.0,
        head_dim: int | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        rotary_fraction: float = 1.0,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_plus_one: bool = False,
        query_scale: float | None = None,
        logit_softcap: float | None = None,
        output_gate: bool = False,
    ):
        require_key(key)
        require_bool(output_gate=output_gate)
        n_kv_heads = _check_heads(d_model, n_heads, n_kv_heads, head_dim)
        d_head = d_model // n_heads if head_dim is None else int(head_dim)
        _check_rope(rope_base, d_head, rotary_fraction)
        self.rope_scaling = check_rope_scaling(rope_scaling)
        self.rotary_fraction = float(rotary_fraction)
        require_bool(causal=causal)
        _check_window(window, causal)
        _check_longrope(self.rope_scaling, rope_base, d_head, rotary_fraction, window)
        implementation = resolve_implementation(memory_efficient, implementation)
        self.query_scale = _check_number("query_scale", query_scale)
        self.logit_softcap = _check_number("logit_softcap", logit_softcap)
        if self.logit_softcap is not None:
            implementation = _softcap_implementation(implementation)
        self.q_norm, self.k_norm = _qk_norms(
            qk_norm, n_heads, n_kv_heads, d_head, qk_norm_eps, qk_norm_plus_one
        )
        self._build_projections(key, d_model, n_heads, n_kv_heads, d_model, use_bias, d_head)
        bound = 1.0 / math.sqrt(d_model)
        gate_key = jr.fold_in(key, 5)  # apart from the projections' keys: they stay as they were
        self.W_G = (
            Param(jr.uniform(gate_key, (d_model, n_heads * d_head), minval=-bound, maxval=bound))
            if output_gate
            else None
        )
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.rope_base = None if rope_base is None else float(rope_base)
        require_rate(attention_dropout=attention_dropout)
        self.attention_dropout = float(attention_dropout)
        self.causal = causal
        self.window = window
        self.implementation = implementation

    def _cache_shape(self, rows: int) -> tuple[int, int, int]:
        """A fixed or ring cache's buffers: per key/value head, `(n_kv_heads, rows, d_head)`, so
        a step reads each head's keys contiguously with no transpose."""
        return (self.n_kv_heads, rows, self.d_head)

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T d_model"],
        *,
        mask: Bool[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_model"]:
        if key is not None and self.attention_dropout > 0:
            return self._forward_dropping_weights(x, mask, key)
        keys, values = self.keys_values(x)
        return self.attend_sequence(x, keys, values, mask, self.causal, self.window)

    def _forward_dropping_weights(self, x: Array, mask: Array | None, key: PRNGKeyArray) -> Array:
        """`forward` in training with dropout on the attention weights."""
        length = x.shape[0]
        visible = _sequence_mask(length, length, self.causal, self.window, mask)
        return self.attend_dropping_weights(x, *self.keys_values(x), visible, key)

    @shape_checked
    def attention_weights(
        self, x: Float[Array, "T d_model"], *, mask: Bool[Array, " T"] | None = None
    ) -> Float[Array, "n_heads T T"]:
        """The attention weights of `forward(x, mask=mask)`, `(n_heads, T, T)`, in float32."""
        length = x.shape[0]
        visible = _sequence_mask(length, length, self.causal, self.window, mask)
        weights = self.weights(x, self.keys_values(x)[0], visible)
        return weights.reshape(self.n_heads, length, length)

    def init_cache(self, capacity: int | None = None, *, on_overflow: str = "raise") -> Cache:
        """An empty cache: growing (`capacity=None`, two `(0, d_model)` arrays) or fixed.

        A fixed cache holds `capacity` steps; `on_overflow` (`"raise"` or `"nan"`) says what a
        step past that does (see `dense_armor.nn.state.counter`). A windowed layer ignores
        `capacity`: its cache is a ring of `window` rows that never overflows.
        """
        _require_causal(self)
        validate_overflow_mode(on_overflow)
        # Keys and values get buffers of their own, so that both can be donated.
        if self.window is not None:
            zeros = self._cache_shape(self.window)
            return RingKVCache(jnp.zeros(zeros), jnp.zeros(zeros), jnp.zeros((), jnp.int32))
        if capacity is None:
            width = self.n_kv_heads * self.d_head
            return KVCache(jnp.zeros((0, width)), jnp.zeros((0, width)))
        require_positive(capacity=capacity)
        zeros = self._cache_shape(capacity)
        counter = Counter.start(on_overflow, capacity)
        return FixedKVCache(keys=jnp.zeros(zeros), values=jnp.zeros(zeros), counter=counter)

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: Cache
    ) -> tuple[Float[Array, "K d_model"], Cache]:
        """`K` causal steps at once: the chunk's keys and values go into `cache` (the cache owns
        the write: `cache.update`), and each row attends to what its step may see.

        A long chunk (scores of `K` rows against the cache's keys past `BLOCKED_MIN_LENGTH ** 2`
        per head, or any chunk with `memory_efficient=True`) goes through in pieces of as many
        rows as stay under that bound, one after the other (a `jax.lax.scan` for a fixed or
        ring cache): each piece is a prefill of its own, so the result is the same and the
        scores never exceed the bound.

        **Returns:** `(y, cache)`, `y (K, d_model)`: what `K` calls of `step` return, stacked, to
        float32 round-off. A fixed cache with too little room applies its overflow rule to the
        rows past its capacity, as `step` would.
        """
        return self._steps(x, cache, called_as(self, "MultiHeadSelfAttention.prefill"))

    def _steps(self, x: Array, cache: Cache, owner: str) -> tuple[Array, Cache]:
        """`prefill`'s work, for `prefill` and `step` (`owner`, in the cache's errors)."""
        _require_causal(self)
        rows = self._piece_rows(x, cache, owner)
        if rows is None:
            return self._prefill(x, cache, owner)
        full, extra = divmod(x.shape[0], rows)
        pieces = x[: full * rows].reshape(full, rows, x.shape[1])
        if cache.fixed_shape:

            def piece(cache: Any, x: Array) -> tuple[Any, Array]:
                y, cache = self._prefill(x, cache, owner)
                return cache, y

            cache, ys = jax.lax.scan(piece, cache, pieces)
            outputs = [ys.reshape(full * rows, x.shape[1])]
        else:  # a growing cache changes shape with every piece
            outputs = []
            for chunk in pieces:
                y, cache = self._prefill(chunk, cache, owner)
                outputs.append(y)
        if extra:
            y, cache = self._prefill(x[full * rows :], cache, owner)
            outputs.append(y)
        return jnp.concatenate(outputs), cache

    def _piece_rows(
        self, x: Array, cache: Cache, owner: str = "MultiHeadSelfAttention.prefill"
    ) -> int | None:
        """The rows of `x` to attend at once, or `None` for all of them."""
        steps = x.shape[0]
        if not isinstance(steps, int) or steps == 0:
            return None  # a symbolic chunk length (export) is attended whole
        new = jax.ShapeDtypeStruct((self.n_kv_heads, steps, self.d_head), x.dtype)
        # The keys the chunk attends over, as the cache's own update would give them.
        keys = jax.eval_shape(lambda k: cache.update(k, k, self.window, owner).keys, new)
        if choose_kernel(self.implementation, steps, keys.shape[1]) != "blocked":
            return None
        rows = max(1, blocked.BLOCKED_MIN_LENGTH**2 // keys.shape[1])
        return rows if rows < steps else None

    def _prefill(self, x: Array, cache: Cache, owner: str) -> tuple[Array, Any]:
        keys, values = (_heads(a, self.n_kv_heads) for a in self.keys_values(x))
        update = cache.update(keys, values, self.window, owner)
        positions = (update.query_positions, update.key_positions)
        scales = None
        if update.key_scales is not None and update.value_scales is not None:  # an int8 cache
            scales = (update.key_scales, update.value_scales)
        y = self.attend_heads(
            x, update.keys, update.values, update.visible, positions, update.hidden_zeros, scales,
            update.pages,
        )  # fmt: skip
        return update.cache.guard(y, update.fits), update.cache
