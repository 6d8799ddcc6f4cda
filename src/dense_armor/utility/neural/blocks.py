"""The blocks: the Transformer encoder block (Vaswani et al. 2017, page 3), the same block around a
recurrent layer (in `recurrent_block`), the decoder block (in `decoder_block`) and the learned gate
that can replace their residual additions.

Each block writes its equations once (`MixerBlock`), around a callable that mixes the steps:
`forward` passes the mixer's forward, `step` and `prefill` pass its `prefill` on the cache.
"""

import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .attention import _check_heads, _project
from .cache import FixedKVCache, KVCache, RingKVCache
from .core import (
    Layer,
    Param,
    python_scalar,
    require_bool,
    require_key,
    require_positive,
    shape_checked,
)
from .layers import Dropout, FeedForward, LayerNorm
from .self_attention import MultiHeadSelfAttention

__all__ = [
    "DecoderCache",
    "Gate",
    "MixerBlock",
    "RecurrentBlock",
    "TransformerBlock",
    "TransformerDecoderBlock",
]


REMAT = (None, "block", "attention")


def _check_remat(remat: str | None) -> str | None:
    if remat not in REMAT:
        raise ValueError(
            f"`remat` must be one of {REMAT} (recompute in the backward pass: nothing, the whole "
            f"block, or the attention); received `remat={remat!r}`."
        )
    return remat


def _rematerialised(attention: Callable[[Array], Array], remat: str | None) -> Any:
    """`attention`, its activations recomputed in the backward pass when `remat="attention"`
    (`jax.checkpoint`, saving nothing inside it: the `(n_heads, T, T)` scores are the memory)."""
    if remat != "attention":
        return attention
    return jax.checkpoint(attention, policy=jax.checkpoint_policies.nothing_saveable)


def _residual(
    block: "MixerBlock | TransformerDecoderBlock",
    i: int,
    x: Array,
    sub: Array,
    key: PRNGKeyArray | None,
) -> Array:
    """A block's `i`-th residual connection: `x + Dropout(sub)`, or its `i`-th gate of the two."""
    sub = block.dropout(sub, key=key)
    return block.gates[i](x, sub) if block.gates else x + sub


class MixerBlock(Layer):
    """The structure every block shares around its sequence mixer (an attention or a recurrent
    layer): post-LN (the page's) `y = LayerNorm(x + Dropout(Mix(x)))`, `z = LayerNorm(y +
    Dropout(FFN(y)))`, or pre-LN `y = x + Mix(LayerNorm(x))`, `z = y + FFN(LayerNorm(y))`, each
    residual addition optionally a `Gate`. The equations are written once (`_apply`), around a
    callable that mixes the steps, for `forward`, `step` and `prefill`; `TransformerBlock` and
    `RecurrentBlock` differ only in their mixer."""

    norm1: eqx.AbstractVar[LayerNorm]
    feed_forward: eqx.AbstractVar[FeedForward]
    norm2: eqx.AbstractVar[LayerNorm]
    dropout: eqx.AbstractVar[Dropout]
    gates: eqx.AbstractVar["tuple[Gate, ...]"]
    d_model: eqx.AbstractVar[int]
    norm_first: eqx.AbstractVar[bool]
    remat: eqx.AbstractVar[str | None]
    accepts_mask: ClassVar[bool] = True

    @property
    def mixer(self) -> Layer:
        raise NotImplementedError

    def _build_around_mixer(
        self,
        d_model: int,
        d_ff: int,
        key: PRNGKeyArray,
        ffn_key: PRNGKeyArray,
        dropout: float,
        gate: bool,
        norm_first: bool,
        remat: str | None,
        activation: str,
        layer_norm_eps: float,
    ) -> None:
        """The fields every block has besides its mixer (called from a block's `__init__`)."""
        self.norm1 = LayerNorm(d_model, layer_norm_eps)
        self.feed_forward = FeedForward(d_model, d_ff, ffn_key, activation)
        self.norm2 = LayerNorm(d_model, layer_norm_eps)
        self.dropout = Dropout(dropout)
        # Gate keys come from a separate fold, so gate=False models keep their weights.
        gate_keys = jr.split(jr.fold_in(key, 1), 2)
        self.gates = tuple(Gate(d_model, k) for k in gate_keys) if gate else ()
        self.d_model = d_model
        self.norm_first = norm_first
        self.remat = _check_remat(remat)

    @property
    def causal(self) -> bool:
        return bool(getattr(self.mixer, "causal", False))

    def _join(self, i: int, x: Array, sub: Array, key: PRNGKeyArray | None) -> Array:
        return _residual(self, i, x, sub, key)

    def _apply(
        self, x: Array, attend: Callable[[Array], tuple[Array, Any]], key: PRNGKeyArray | None
    ) -> tuple[Array, Any]:
        """The block's equations, written once for `forward`, `step` and `prefill`, around a
        mixer `attend(h) -> (a, cache)`: post-LN (the page's) or pre-LN."""
        akey, fkey = (None, None) if key is None else jr.split(key)
        if self.norm_first:
            a, cache = attend(self.norm1(x))
            y = self._join(0, x, a, akey)
            return self._join(1, y, self.feed_forward(self.norm2(y)), fkey), cache
        a, cache = attend(x)
        y = self.norm1(self._join(0, x, a, akey))
        return self.norm2(self._join(1, y, self.feed_forward(y), fkey)), cache

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T d_model"],
        *,
        mask: Bool[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_model"]:
        """`(T, d_model) -> (T, d_model)`; `mask` the padding mask of `Layer`, `key` for
        dropout. The mixer or the whole block is rematerialised as `remat` says."""
        return self._forward(x, mask, key)

    def _forward(self, x: Array, mask: Array | None, key: PRNGKeyArray | None) -> Array:
        mixer_key = None if key is None else jr.fold_in(key, 2)  # the others' keys unchanged
        mix = _rematerialised(lambda h: self.mixer(h, mask=mask, key=mixer_key), self.remat)
        run = lambda x: self._apply(x, lambda h: (mix(h), None), key)[0]  # noqa: E731
        return jax.checkpoint(run)(x) if self.remat == "block" else run(x)

    def init_cache(self, capacity: int | None = None, *, on_overflow: str = "raise") -> Any:
        """The mixer's cache (an attention's keys and values, a recurrent layer's state)."""
        return self.mixer.init_cache(capacity, on_overflow=on_overflow)

    def _prefill(self, x: Array, cache: Any) -> tuple[Array, Any]:
        return self._apply(x, lambda h: self.mixer.prefill(h, cache), None)


class TransformerBlock(MixerBlock):
    """The post-LayerNorm Transformer block (Vaswani et al. 2017, page 3 and Eq.(2), page 5).

    `y = LayerNorm(x + Dropout(Attention(x)))`, then `z = LayerNorm(y + Dropout(FFN(y)))`.

    **Arguments:** `d_model`, `n_heads`, `d_ff` (the hidden width of the feed-forward), `key`,
    `causal=False`, `dropout=0.0` (applied to each sub-layer's output before the residual
    addition, only when `forward` gets a `key`), `gate=False` (a `Gate` replaces each residual
    addition: `y = LayerNorm(Gate(x, Attention(x)))`, ...), `norm_first=False` (pre-LN instead:
    `y = x + Attention(LayerNorm(x))`, `z = y + FFN(LayerNorm(y))`, Xiong et al. 2020),
    `window=None` (sliding-window attention), `memory_efficient=None` (blocked attention; see
    `MultiHeadSelfAttention`) and `remat=None` (`"block"`: the block's activations are recomputed
    in the backward pass instead of stored, `jax.checkpoint`; `"attention"`: only the
    attention's, whose `(n_heads, T, T)` scores are most of them) and `implementation=None` (how
    the attention is computed; see `MultiHeadSelfAttention`), `n_kv_heads=None` (grouped-query
    attention: keys and values in `n_kv_heads` heads, each shared by `n_heads / n_kv_heads` query
    heads; default `n_heads`), `rope_base=None` (rotary positions in the self-attention), and
    the options PyTorch's layers expose: `use_bias=False` (biases on the attention projections),
    `activation="relu"` (or `"gelu"`, of the feed-forward), `layer_norm_eps=1e-5` and
    `attention_dropout=0.0` (on the self-attention's weights).

    `forward(x, mask=None)`, `mask` the padding mask of `Layer`.

    `params()` is, in order, the attention's `[W_Q, W_K, W_V, W_O]`, the first LayerNorm's
    `[gain, bias]`, the feed-forward's `[W_1, b_1, W_2, b_2]` and the second LayerNorm's
    `[gain, bias]`: 12 in all; then, with `gate=True`, each gate's `[U, W, b]` (18 in all).
    A causal block streams like `MultiHeadSelfAttention`.
    """

    attention: MultiHeadSelfAttention
    norm1: LayerNorm
    feed_forward: FeedForward
    norm2: LayerNorm
    dropout: Dropout
    gates: "tuple[Gate, ...]"
    d_model: int = eqx.field(static=True, converter=python_scalar)
    norm_first: bool = eqx.field(static=True, converter=python_scalar)
    remat: str | None = eqx.field(static=True, converter=python_scalar)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        key: PRNGKeyArray,
        causal: bool = False,
        dropout: float = 0.0,
        gate: bool = False,
        norm_first: bool = False,
        window: int | None = None,
        memory_efficient: bool | None = None,
        remat: str | None = None,
        implementation: str | None = None,
        n_kv_heads: int | None = None,
        rope_base: float | None = None,
        use_bias: bool = False,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
        attention_dropout: float = 0.0,
    ):
        require_key(key)
        _check_heads(d_model, n_heads)
        require_positive(d_ff=d_ff)
        require_bool(gate=gate, norm_first=norm_first)
        akey, fkey = jr.split(key)
        self.attention = MultiHeadSelfAttention(
            d_model,
            n_heads,
            akey,
            causal=causal,
            window=window,
            memory_efficient=memory_efficient,
            implementation=implementation,
            n_kv_heads=n_kv_heads,
            rope_base=rope_base,
            use_bias=use_bias,
            attention_dropout=attention_dropout,
        )
        self._build_around_mixer(
            d_model, d_ff, key, fkey, dropout, gate, norm_first, remat, activation, layer_norm_eps
        )

    @property
    def mixer(self) -> MultiHeadSelfAttention:
        return self.attention

    @shape_checked
    def attention_weights(
        self, x: Float[Array, "T d_model"], *, mask: Bool[Array, " T"] | None = None
    ) -> Float[Array, "n_heads T T"]:
        """The weights `(n_heads, T, T)` of the block's attention on the input `x`."""
        return self.attention.attention_weights(self.norm1(x) if self.norm_first else x, mask=mask)

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: KVCache | FixedKVCache | RingKVCache
    ) -> tuple[Float[Array, "K d_model"], KVCache | FixedKVCache | RingKVCache]:
        """`K` causal steps of the block at once; see `MultiHeadSelfAttention.prefill`."""
        return self._prefill(x, cache)

    @shape_checked
    def step(
        self, x_t: Float[Array, " d_model"], cache: KVCache | FixedKVCache | RingKVCache
    ) -> tuple[Float[Array, " d_model"], KVCache | FixedKVCache | RingKVCache]:
        """One causal step of the block; see `MultiHeadSelfAttention.step`."""
        y, cache = self.prefill(x_t[None], cache)
        return y[0], cache


class Gate(Layer):
    """A learned elementwise gate between a residual stream `x` and a sub-layer's output `y`:

    `g = sigmoid(x U + y W - b)`, `z = (1 - g) * x + g * y`.

    This is the highway connection (Srivastava et al. 2015, "Highway Networks", Section 2,
    Eq.(3)) with its gate conditioned on both signals, as the update gate `z` of the GRU-type
    gating of Parisotto et al. 2019 ("Stabilizing Transformers for Reinforcement Learning",
    Section 3.2), which uses it in place of a Transformer's residual addition. Unlike that GRU gate,
    its extremes are the inputs themselves (`g -> 0` gives `x`, `g -> 1` gives `y`), so a gated
    block can still learn the plain residual path exactly. `b` starts at `bias=2.0`, so `g` starts
    near `sigmoid(-2) = 0.12` and the gated block starts close to the identity, as Parisotto et al.
    recommend for their `b_g`.

    **Arguments:** `d_model`, `key`, `bias=2.0`. `params()` is `[U, W, b]`.
    """

    U: Param
    W: Param
    b: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)

    def __init__(self, d_model: int, key: PRNGKeyArray, bias: float = 2.0):
        require_key(key)
        require_positive(d_model=d_model)
        ukey, wkey = jr.split(key)
        bound = 1.0 / math.sqrt(d_model)
        self.U = Param(jr.uniform(ukey, (d_model, d_model), minval=-bound, maxval=bound))
        self.W = Param(jr.uniform(wkey, (d_model, d_model), minval=-bound, maxval=bound))
        self.b = Param(jnp.full((d_model,), bias, jnp.float32))
        self.d_model = d_model

    @shape_checked
    def forward(
        self,
        x: Float[Array, "*T d_model"],
        y: Float[Array, "*T d_model"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*T d_model"]:
        logits = _project(x, self.U) + _project(y, self.W)
        g = jax.nn.sigmoid(logits - jnp.broadcast_to(self.b.value.astype(x.dtype), logits.shape))
        return (1 - g) * x + g * y


# The decoder block lives in `decoder_block`, the recurrent one in `recurrent_block`; their names
# are the blocks' too.
from .decoder_block import DecoderCache, TransformerDecoderBlock  # noqa: E402
from .recurrent_block import RecurrentBlock  # noqa: E402
