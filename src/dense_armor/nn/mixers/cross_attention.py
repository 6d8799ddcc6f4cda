"""Multi-head attention from one sequence to another (Vaswani et al. 2017, page 5,
"encoder-decoder attention"), whose cache is the context projected once."""

from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import (
    Param,
    ShapeError,
    called_as,
    python_scalar,
    require_key,
    require_positive,
    require_rate,
    shape_checked,
)
from ..kernels.choice import resolve_implementation
from .heads import MultiHeadAttention, _check_heads

__all__ = ["ContextCache", "MultiHeadCrossAttention"]


class ContextCache(NamedTuple):
    """A context's projected keys and values, `(S, d_model)` each, and its mask `(S,)`."""

    keys: Float[Array, "S d_model"]
    values: Float[Array, "S d_model"]
    mask: Bool[Array, " S"]


class MultiHeadCrossAttention(MultiHeadAttention):
    """Multi-head attention from one sequence to another: queries from `x (T, d_model)`, keys and
    values from a context `(S, d_context)` (Vaswani et al. 2017, page 5, "encoder-decoder
    attention"). Four projections, no biases: `W_Q (d_model, d_model)`, `W_K` and `W_V`
    `(d_context, d_model)`, `W_O (d_model, d_model)`.

    **Arguments:** `d_model` (divisible by `n_heads`), `n_heads`, `key`, `d_context=None` (the
    context's width; default `d_model`), `implementation=None` (as in `MultiHeadSelfAttention`;
    `"auto"` attends in blocks when `T * S >= BLOCKED_MIN_LENGTH ** 2`) and its older spelling
    `memory_efficient=None`.

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
    n_kv_heads: int = eqx.field(static=True, converter=python_scalar)
    d_context: int = eqx.field(static=True, converter=python_scalar)
    implementation: str = eqx.field(static=True, converter=python_scalar)
    attention_dropout: float = eqx.field(static=True, converter=python_scalar)
    b_Q: Param | None
    b_K: Param | None
    b_V: Param | None
    b_O: Param | None
    # Rotary positions are the self-attention's: a context's steps have no place in the sequence;
    # the options of the checkpoints' self-attentions (see `MultiHeadSelfAttention`) are not
    # taken here.
    rope_base: None = eqx.field(static=True)
    head_dim: int = eqx.field(static=True, converter=python_scalar)
    rope_scaling: None = eqx.field(static=True)
    rotary_fraction: float = eqx.field(static=True)
    q_norm: None
    k_norm: None
    W_G: None
    query_scale: None = eqx.field(static=True)
    logit_softcap: None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        key: PRNGKeyArray,
        d_context: int | None = None,
        memory_efficient: bool | None = None,
        implementation: str | None = None,
        n_kv_heads: int | None = None,
        use_bias: bool = False,
        attention_dropout: float = 0.0,
    ):
        require_key(key)
        n_kv_heads = _check_heads(d_model, n_heads, n_kv_heads)
        implementation = resolve_implementation(memory_efficient, implementation)
        d_context = d_model if d_context is None else d_context
        require_positive(d_context=d_context)
        self._build_projections(key, d_model, n_heads, n_kv_heads, d_context, use_bias)
        self.d_model, self.n_heads, self.d_context = d_model, n_heads, d_context
        self.n_kv_heads = n_kv_heads
        self.rope_base = self.rope_scaling = self.query_scale = self.logit_softcap = None
        self.q_norm = self.k_norm = self.W_G = None
        self.rotary_fraction = 1.0
        require_rate(attention_dropout=attention_dropout)
        self.attention_dropout = float(attention_dropout)
        self.implementation = implementation

    @shape_checked
    def init_cache(
        self, context: Float[Array, "S d_context"], *, context_mask: Bool[Array, " S"] | None = None
    ) -> ContextCache:
        """Project the context's keys and values once, for `step`."""
        mask = jnp.ones(context.shape[0], bool) if context_mask is None else context_mask
        keys, values = self.keys_values(context)
        return ContextCache(keys, values, mask)

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T d_model"],
        context: Float[Array, "S d_context"],
        *,
        context_mask: Bool[Array, " S"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_model"]:
        cache = self.init_cache(context, context_mask=context_mask)
        return self.step_sequence(x, cache, key=key)

    def step_sequence(
        self, x: Array, cache: ContextCache, key: PRNGKeyArray | None = None
    ) -> Array:
        """Attend from every row of `x (T, d_model)` to a projected context; with a `key` and an
        `attention_dropout`, its weights dropped."""
        if key is not None and self.attention_dropout > 0:
            return self.attend_dropping_weights(
                x, cache.keys, cache.values, cache.mask[None, :], key
            )
        return self.attend_sequence(x, cache.keys, cache.values, cache.mask)

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: ContextCache
    ) -> tuple[Float[Array, "K d_model"], ContextCache]:
        """`K` queries against the cached context at once; the cache comes back unchanged."""
        width = self.n_kv_heads * self.d_head
        if cache.keys.ndim != 2 or cache.keys.shape[1] != width:
            caller = called_as(self, "MultiHeadCrossAttention.prefill")
            raise ShapeError(
                f"{caller}: received `cache.keys.shape={cache.keys.shape}`; "
                f"expected `(S, {width})`. Use `init_cache(context)`."
            )
        return self.step_sequence(x, cache), cache
