"""Multi-head attention from one sequence to another (Vaswani et al. 2017, page 5,
"encoder-decoder attention"), whose cache is the context projected once."""

import math
from collections.abc import Mapping
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .attention import (
    HEAD_SPLIT,
    _attend_sequence,
    _biases,
    _check_heads,
    _dropped,
    _projected,
)
from .core import (
    Layer,
    Param,
    ShapeError,
    python_scalar,
    require_key,
    require_positive,
    require_rate,
    shape_checked,
)
from .kernels import resolve_implementation

__all__ = ["ContextCache", "MultiHeadCrossAttention"]


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
    attention_dropout: float = eqx.field(static=True, converter=python_scalar, default=0.0)
    b_Q: Param | None = None
    b_K: Param | None = None
    b_V: Param | None = None
    b_O: Param | None = None
    tensor_parallel: ClassVar[Mapping[str, tuple[int, str | None]]] = HEAD_SPLIT

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
        qkey, kkey, vkey, okey = jr.split(key, 4)

        def init(k: PRNGKeyArray, d_in: int, width: int = d_model) -> Param:
            bound = 1.0 / math.sqrt(d_in)
            return Param(jr.uniform(k, (d_in, width), minval=-bound, maxval=bound))

        kv_width = n_kv_heads * (d_model // n_heads)
        self.W_Q, self.W_K = init(qkey, d_model), init(kkey, d_context, kv_width)
        self.W_V, self.W_O = init(vkey, d_context, kv_width), init(okey, d_model)
        self.d_model, self.n_heads, self.d_context = d_model, n_heads, d_context
        self.n_kv_heads = n_kv_heads
        require_rate(attention_dropout=attention_dropout)
        self.attention_dropout = float(attention_dropout)
        widths = {"Q": d_model, "K": kv_width, "V": kv_width, "O": d_model}
        for name, bias in _biases(use_bias, widths).items():
            setattr(self, name, bias)
        self.implementation = implementation

    @property
    def memory_efficient(self) -> bool | None:
        """`implementation` in the older spelling: blocked (`True`), not (`False`) or by length."""
        return {"auto": None, "blocked": True}.get(self.implementation, False)

    @shape_checked
    def init_cache(
        self, context: Float[Array, "S d_context"], *, context_mask: Bool[Array, " S"] | None = None
    ) -> ContextCache:
        """Project the context's keys and values once, for `step`."""
        mask = jnp.ones(context.shape[0], bool) if context_mask is None else context_mask
        keys, values = _projected(self, context, "K"), _projected(self, context, "V")
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
            return _dropped(self, x, cache.keys, cache.values, cache.mask[None, :], key)
        return _attend_sequence(self, x, cache.keys, cache.values, cache.mask)

    @shape_checked
    def step(
        self, x_t: Float[Array, " d_model"], cache: ContextCache
    ) -> tuple[Float[Array, " d_model"], ContextCache]:
        """One query against the cached context; the cache comes back unchanged."""
        width = self.W_K.value.shape[1]
        if cache.keys.ndim != 2 or cache.keys.shape[1] != width:
            raise ShapeError(
                f"MultiHeadCrossAttention.step: received `cache.keys.shape={cache.keys.shape}`; "
                f"expected `(S, {width})`. Use `init_cache(context)`."
            )
        return self.step_sequence(x_t[None], cache)[0], cache

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: ContextCache
    ) -> tuple[Float[Array, "K d_model"], ContextCache]:
        """`K` queries against the cached context at once; the cache comes back unchanged."""
        return self.step_sequence(x, cache), cache
