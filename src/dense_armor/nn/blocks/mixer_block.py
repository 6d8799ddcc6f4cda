"""What every block shares: `Block`, the residual equations written once over a tuple of
sub-layers; `MixerBlock`, those equations around a sequence mixer and the feed-forward (`forward`
passes the mixer's forward, `step` and `prefill` its `prefill` on the cache); the learned `Gate`
that can replace a residual addition; the checks every block's arguments share, and remat. The
blocks themselves: `transformer_block`, `recurrent_block`, `decoder_block`.
"""

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import (
    Layer,
    Param,
    python_scalar,
    require_bool,
    require_choice,
    require_key,
    require_positive,
    shape_checked,
)
from ..layers.basic import Dropout, FeedForward, LayerNorm
from ..layers.experts import MixtureOfExperts
from ..layers.language import GatedFeedForward, RMSNorm

__all__ = ["Block", "Gate", "MixerBlock", "make_norm"]


REMAT = (None, "block", "attention")
# A block's normalisation (`norm=`): LayerNorm (the page's; GPT-2's) or RMSNorm (Llama's); its
# feed-forward (`feed_forward=`): the two-layer MLP or the gated one (SwiGLU with "silu").
NORMS = ("layer", "rms", "rms_plus_one")
FEED_FORWARDS = ("mlp", "gated", "moe")
# Where a pre-LN block's norms go (`norm_placement=`): on each sub-layer's input (the usual
# pre-LN), on its output before the residual addition (OLMo 2's), or both (Gemma 2/3's four norms
# per block).
NORM_PLACEMENTS = ("input", "output", "both")
Norm = LayerNorm | RMSNorm
Feed = FeedForward | GatedFeedForward | MixtureOfExperts


def _check_remat(remat: str | None) -> str | None:
    if remat not in REMAT:
        raise ValueError(
            f"`remat` must be one of {REMAT} (recompute in the backward pass: nothing, the whole "
            f"block, or the attention); received `remat={remat!r}`."
        )
    return remat


def _check_block(key: Any, d_model: int, d_ff: int, gate: Any, norm_first: Any) -> None:
    """The arguments every block takes, checked: its key, widths and flags."""
    require_key(key)
    require_positive(d_model=d_model, d_ff=d_ff)
    require_bool(gate=gate, norm_first=norm_first)


def _rematerialised(attention: Callable[[Array], Array], remat: str | None) -> Any:
    """`attention`, its activations recomputed in the backward pass when `remat="attention"`
    (`jax.checkpoint`, saving nothing inside it: the `(n_heads, T, T)` scores are the memory)."""
    if remat != "attention":
        return attention
    return jax.checkpoint(attention, policy=jax.checkpoint_policies.nothing_saveable)


class Block(Layer):
    """The residual structure of every block: sub-layers (a mixer, a cross-attention, the
    feed-forward) applied in turn, each around a residual addition (or a `Gate`) with dropout on
    its output, post-LN `x = LayerNorm(x + Dropout(Sub(x)))` (the page's) or pre-LN
    `x = x + Dropout(Sub(LayerNorm(x)))`. The equations are written once (`_apply`) for every
    block and every path (`forward`, `step`, `prefill`); a block says which LayerNorms go with
    its sub-layers (`norms`)."""

    dropout: eqx.AbstractVar[Dropout]
    gates: eqx.AbstractVar["tuple[Gate, ...]"]
    d_model: eqx.AbstractVar[int]
    norm_first: eqx.AbstractVar[bool]
    remat: eqx.AbstractVar[str | None]
    stackable: ClassVar[bool] = True

    @property
    @abc.abstractmethod
    def norms(self) -> tuple[Norm, ...]:
        """The LayerNorm (or RMSNorm) of each sub-layer, in order."""

    def _apply(
        self,
        x: Array,
        sublayers: Sequence[Callable[[Array], tuple[Array, Any]]],
        key: PRNGKeyArray | None,
        placement: str = "input",
        output_norms: Sequence[Norm] = (),
    ) -> tuple[Array, Any]:
        """`x` through `sublayers`, each `sub(h) -> (out, extra)`, with the block's residuals and
        norms (a pre-LN block's `placement`: see `NORM_PLACEMENTS`; `output_norms` those on the
        outputs when `placement="both"`); returns the output and each sub-layer's `extra` (the
        mixer's cache first; a mixture of experts' router logits)."""
        keys = [None] * len(sublayers) if key is None else list(jr.split(key, len(sublayers)))
        extras = []
        for i, (sub, norm, sub_key) in enumerate(zip(sublayers, self.norms, keys, strict=True)):
            on_input = self.norm_first and placement != "output"
            out, cache = sub(norm(x) if on_input else x)
            if placement == "output":
                out = norm(out)
            elif placement == "both":
                out = output_norms[i](out)
            extras.append(cache)
            out = self.dropout(out, key=sub_key)
            x = self.gates[i](x, out) if self.gates else x + out
            x = x if self.norm_first else norm(x)
        return x, tuple(extras)


class MixerBlock(Block):
    """The structure every block shares around its sequence mixer (an attention or a recurrent
    layer): post-LN (the page's) `y = LayerNorm(x + Dropout(Mix(x)))`, `z = LayerNorm(y +
    Dropout(FFN(y)))`, or pre-LN `y = x + Mix(LayerNorm(x))`, `z = y + FFN(LayerNorm(y))`, each
    residual addition optionally a `Gate`. The equations are written once (`_apply`), around a
    callable that mixes the steps, for `forward`, `step` and `prefill`; `TransformerBlock` and
    `RecurrentBlock` differ only in their mixer."""

    norm1: eqx.AbstractVar[Norm]
    feed_forward: eqx.AbstractVar[Feed]
    norm2: eqx.AbstractVar[Norm]
    norm_placement: eqx.AbstractVar[str]
    output_norms: eqx.AbstractVar["tuple[Norm, ...]"]
    accepts_mask: ClassVar[bool] = True

    @property
    @abc.abstractmethod
    def mixer(self) -> Layer:
        """The layer that mixes the steps (an attention or a recurrent layer)."""

    @property
    def norms(self) -> tuple[Norm, ...]:
        return (self.norm1, self.norm2)

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
        norm: str = "layer",
        feed_forward: str = "mlp",
        norm_placement: str = "input",
        experts: dict[str, Any] | None = None,
    ) -> None:
        """The fields every block has besides its mixer (called from a block's `__init__`);
        `experts`, the `MixtureOfExperts` options with `feed_forward="moe"`."""
        require_choice("norm", norm, NORMS)
        require_choice("feed_forward", feed_forward, FEED_FORWARDS)
        require_choice("norm_placement", norm_placement, NORM_PLACEMENTS)
        if norm_placement != "input" and not norm_first:
            raise ValueError(
                f"`norm_placement={norm_placement!r}` places a pre-LN block's norms; it needs "
                "`norm_first=True`."
            )
        self.norm1 = make_norm(norm, d_model, layer_norm_eps)
        if feed_forward == "moe":
            self.feed_forward = MixtureOfExperts(
                d_model, d_ff, ffn_key, **(experts or {}), activation=activation
            )
        else:
            feed = FeedForward if feed_forward == "mlp" else GatedFeedForward
            self.feed_forward = feed(d_model, d_ff, ffn_key, activation)
        self.norm2 = make_norm(norm, d_model, layer_norm_eps)
        self.norm_placement = norm_placement
        both = norm_placement == "both"
        self.output_norms = tuple(make_norm(norm, d_model, layer_norm_eps) for _ in "12" if both)
        self.dropout = Dropout(dropout)
        # Gate keys come from a separate fold, so gate=False models keep their weights.
        gate_keys = jr.split(jr.fold_in(key, 1), 2)
        self.gates = tuple(Gate(d_model, k) for k in gate_keys) if gate else ()
        self.d_model = d_model
        self.norm_first = norm_first
        self.remat = _check_remat(remat)

    @property
    def causal(self) -> bool:  # type: ignore[override]  # the mixer's (a Layer class variable)
        return self.mixer.causal

    def _mix_then_feed_forward(
        self, x: Array, mix: Callable[[Array], tuple[Array, Any]], key: PRNGKeyArray | None
    ) -> tuple[Array, Any]:
        """The block's equations around a mixer `mix(h) -> (a, cache)`, for every path."""
        sublayers = (mix, lambda h: (self.feed_forward(h), None))
        y, extras = self._apply(x, sublayers, key, self.norm_placement, self.output_norms)
        return y, extras[0]

    def forward_routed(self, x: Array) -> tuple[Array, Array]:
        """`forward(x)` (no mask, no dropout) and its mixture of experts' router logits
        `(T, n_experts)`, for the load-balancing loss."""
        if not isinstance(self.feed_forward, MixtureOfExperts):
            raise ValueError(
                "forward_routed: this block's feed-forward is not a mixture of experts."
            )
        sublayers = (lambda h: (self.mixer(h), None), self.feed_forward.routed)
        y, extras = self._apply(x, sublayers, None, self.norm_placement, self.output_norms)
        return y, extras[1]

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
        run = lambda x: self._mix_then_feed_forward(x, lambda h: (mix(h), None), key)[0]  # noqa: E731
        return jax.checkpoint(run)(x) if self.remat == "block" else run(x)

    def init_cache(self, capacity: int | None = None, *, on_overflow: str = "raise") -> Any:
        """The mixer's cache (an attention's keys and values, a recurrent layer's state)."""
        return self.mixer.init_cache(capacity, on_overflow=on_overflow)

    def _prefill(self, x: Array, cache: Any) -> tuple[Array, Any]:
        return self._mix_then_feed_forward(x, lambda h: self.mixer.prefill(h, cache), None)


def make_norm(norm: str, d_model: int, eps: float) -> Norm:
    """The norm that `norm` names (`NORMS`): LayerNorm, RMSNorm, or Gemma's RMSNorm (`1 + w`)."""
    if norm == "layer":
        return LayerNorm(d_model, eps)
    return RMSNorm(d_model, eps, plus_one=norm == "rms_plus_one")


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
        logits = self.U.project(x) + self.W.project(y)
        g = jax.nn.sigmoid(logits - jnp.broadcast_to(self.b.value.astype(x.dtype), logits.shape))
        return (1 - g) * x + g * y
