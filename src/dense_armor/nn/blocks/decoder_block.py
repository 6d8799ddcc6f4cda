"""The Transformer decoder block (Vaswani et al. 2017, page 3): masked self-attention, attention
to a context, and the feed-forward, each around a residual connection, post-LN or pre-LN; it
streams with a `DecoderCache`. Its helpers (residuals, gates, remat) are the encoder block's, in
`blocks`."""

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import (
    python_scalar,
    shape_checked,
)
from ..layers.basic import Dropout, FeedForward, LayerNorm
from ..mixers.cross_attention import ContextCache, MultiHeadCrossAttention
from ..mixers.heads import _check_heads
from ..mixers.options import attention_options
from ..mixers.self_attention import MultiHeadSelfAttention
from ..state.cache import FixedKVCache, KVCache, RingKVCache
from ..state.paged import PagedKVCache
from .mixer_block import Block, Gate, _check_block, _check_remat, _rematerialised

__all__ = ["DecoderCache", "TransformerDecoderBlock"]


class DecoderCache(NamedTuple):
    """A decoder block's caches: its causal self-attention's and its projected context."""

    self_attention: KVCache | FixedKVCache | RingKVCache | PagedKVCache
    context: ContextCache


class TransformerDecoderBlock(Block):
    """The decoder block (Vaswani et al. 2017, page 3): causal self-attention, attention to a
    context, and the feed-forward, each followed by its residual addition (or a `Gate`) and a
    LayerNorm:

    `y = LN(x + SelfAttention(x))`, `u = LN(y + CrossAttention(y, context))`, `z = LN(u + FFN(u))`.

    **Arguments:** `d_model`, `n_heads`, `d_ff`, `key`, `d_context=None` (default `d_model`),
    `dropout=0.0` (on each sub-layer's output, with a `key`), `gate=False` (a `Gate` replaces each
    residual addition), `norm_first=False` (pre-LN, as in `TransformerBlock`:
    `y = x + SelfAttention(LN(x))`, `u = y + CrossAttention(LN(y), context)`,
    `z = u + FFN(LN(u))`), `remat`, `activation` and `layer_norm_eps` as in `TransformerBlock`;
    every other keyword is an attention option (`**attention`, as in `TransformerBlock`), given
    to the self-attention, and to the cross-attention where it takes it (`implementation`,
    `n_kv_heads`, `use_bias`, `attention_dropout`; `window=None`, sliding-window
    self-attention whose cache is a ring, and `rope_base` are the self-attention's alone).

    `params()`: the self-attention's 4, the first LayerNorm's 2, the cross-attention's 4, the second
    LayerNorm's 2, the feed-forward's 4, the third LayerNorm's 2 (18), then each gate's 3.
    Streaming: `init_cache(context, capacity=None)` then `step(x_t, cache)`.
    """

    self_attention: MultiHeadSelfAttention
    norm1: LayerNorm
    cross_attention: MultiHeadCrossAttention
    norm2: LayerNorm
    feed_forward: FeedForward
    norm3: LayerNorm
    dropout: Dropout
    gates: tuple[Gate, ...]
    d_model: int = eqx.field(static=True, converter=python_scalar)
    d_context: int = eqx.field(static=True, converter=python_scalar)
    norm_first: bool = eqx.field(static=True, converter=python_scalar)
    remat: str | None = eqx.field(static=True, converter=python_scalar)
    causal: ClassVar[bool] = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        key: PRNGKeyArray,
        d_context: int | None = None,
        dropout: float = 0.0,
        gate: bool = False,
        norm_first: bool = False,
        remat: str | None = None,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
        **attention: Any,
    ):
        _check_block(key, d_model, d_ff, gate, norm_first)
        _check_heads(d_model, n_heads)
        owner = "TransformerDecoderBlock"
        skey, ckey, fkey = jr.split(key, 3)
        self.self_attention = MultiHeadSelfAttention(
            d_model, n_heads, skey, causal=True, **attention_options(owner, attention)
        )
        self.norm1 = LayerNorm(d_model, layer_norm_eps)
        cross_options = attention_options(owner, attention, MultiHeadCrossAttention)
        self.cross_attention = MultiHeadCrossAttention(
            d_model, n_heads, ckey, d_context, **cross_options
        )
        self.norm2 = LayerNorm(d_model, layer_norm_eps)
        self.feed_forward = FeedForward(d_model, d_ff, fkey, activation)
        self.norm3 = LayerNorm(d_model, layer_norm_eps)
        self.dropout = Dropout(dropout)
        gate_keys = jr.split(jr.fold_in(key, 1), 3)
        self.gates = tuple(Gate(d_model, k) for k in gate_keys) if gate else ()
        self.d_model = d_model
        self.d_context = self.cross_attention.d_context
        self.norm_first = norm_first
        self.remat = _check_remat(remat)

    @property
    def norms(self) -> tuple[LayerNorm, ...]:
        return (self.norm1, self.norm2, self.norm3)

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T d_model"],
        context: Float[Array, "S d_context"],
        *,
        context_mask: Bool[Array, " S"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_model"]:
        def run(x: Array) -> Array:
            context_cache = self.cross_attention.init_cache(context, context_mask=context_mask)
            attention_key = None if key is None else jr.fold_in(key, 2)
            attention = _rematerialised(
                lambda h: self.self_attention(h, key=attention_key), self.remat
            )
            return self._three_sublayers(x, lambda h: (attention(h), None), context_cache, key)[0]

        return jax.checkpoint(run)(x) if self.remat == "block" else run(x)

    def _three_sublayers(
        self,
        x: Array,
        attend: Callable[[Array], tuple[Array, Any]],
        context: ContextCache,
        key: PRNGKeyArray | None,
    ) -> tuple[Array, Any]:
        """The block's equations (`Block._apply`), for `forward`, `step` and `prefill`, around a
        self-attention `attend(h) -> (a, cache)`, the attention to a projected context and the
        feed-forward."""
        cross_key = None if key is None else jr.fold_in(key, 3)  # the others' keys unchanged

        def cross(h: Array) -> tuple[Array, None]:
            return self.cross_attention.step_sequence(h, context, key=cross_key), None

        y, extras = self._apply(x, (attend, cross, lambda h: (self.feed_forward(h), None)), key)
        return y, extras[0]

    @shape_checked
    def init_cache(
        self,
        context: Float[Array, "S d_context"],
        capacity: int | None = None,
        *,
        context_mask: Bool[Array, " S"] | None = None,
        on_overflow: str = "raise",
    ) -> DecoderCache:
        """The self-attention's cache (growing, or fixed with `capacity`) and the projected
        context."""
        return DecoderCache(
            self.self_attention.init_cache(capacity, on_overflow=on_overflow),
            self.cross_attention.init_cache(context, context_mask=context_mask),
        )

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: DecoderCache
    ) -> tuple[Float[Array, "K d_model"], DecoderCache]:
        """`K` steps at once: what `K` calls of `step` return, stacked."""
        y, self_cache = self._three_sublayers(
            x, lambda h: self.self_attention.prefill(h, cache.self_attention), cache.context, None
        )
        return y, DecoderCache(self_cache, cache.context)
