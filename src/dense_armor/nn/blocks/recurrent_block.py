"""`RecurrentBlock`: the block structure of `MixerBlock` around a recurrent layer, to stack alone
or beside `TransformerBlock`s (`transformer_encoder(..., mixers=...)`, `TransformerLM(...,
mixers=...)`): the classic recurrent layers, LFM2's short convolution and Qwen3.5's Gated
DeltaNet."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..core import Layer, python_scalar, shape_checked
from ..layers.basic import Dropout
from ..mixers.convolution import ConvState, ShortConv
from ..mixers.deltanet import DeltaState, GatedDeltaNet
from ..mixers.recurrent import RECURRENT, HiddenState, LSTMState, Recurrent
from .mixer_block import Feed, Gate, MixerBlock, Norm, _check_block
from .transformer_block import _experts

__all__ = ["MIXERS", "RecurrentBlock"]


def _short_conv(d_model: int, key: PRNGKeyArray, **options: Any) -> Layer:
    return ShortConv(d_model, key, **options)


def _delta_net(d_model: int, key: PRNGKeyArray, **options: Any) -> Layer:
    options = dict(options)
    return GatedDeltaNet(d_model, options.pop("n_heads"), key, **options)


def _classic(kind: str) -> Callable[..., Layer]:
    def make(d_model: int, key: PRNGKeyArray, **options: Any) -> Layer:
        if options:
            raise TypeError(f"the {kind} mixer takes no options; received {sorted(options)}.")
        return RECURRENT[kind](d_model, d_model, key)

    return make


# A recurrent block's mixers by name: `(d_model, key, **options) -> layer`, each on the
# streaming protocol (its state is its cache).
MIXERS: dict[str, Callable[..., Layer]] = {
    **{kind: _classic(kind) for kind in RECURRENT},
    "short_conv": _short_conv,
    "gated_deltanet": _delta_net,
}
State = HiddenState | LSTMState | ConvState | DeltaState


class RecurrentBlock(MixerBlock):
    """The block of `TransformerBlock` with a recurrent layer in place of the attention:
    `y = LayerNorm(x + Dropout(Recurrent(x)))`, then `z = LayerNorm(y + Dropout(FFN(y)))`.

    **Arguments:** `d_model`, `d_ff`, `key`, `mixer="gru"` (`"gru"`, `"lstm"` or `"mingru"`: a
    `GRU`, `LSTM` or `MinGRU` of `d_model` inputs and `d_model` hidden units; `"short_conv"`:
    LFM2's `ShortConv`; `"gated_deltanet"`: Qwen3.5's `GatedDeltaNet`, which needs `n_heads`
    among the `mixer_options`), and as in `TransformerBlock`: `dropout=0.0`, `gate=False`,
    `norm_first=False`, `remat=None` (`"block"`, or `"attention"`, which here recomputes the
    recurrent layer: one option serves a stack that mixes both kinds of block),
    `activation="relu"`, `layer_norm_eps=1e-5`, `norm="layer"`, `feed_forward="mlp"`,
    `norm_placement="input"` and the mixture of experts' `n_experts`, `top_k`,
    `normalize_top_k`, `shared_d_ff`; `mixer_options` go to the mixer (`kernel`, `use_bias` of
    `ShortConv`; `n_heads`, `n_key_heads`, `key_dim`, `value_dim`, `kernel`, `eps`, `chunk` of
    `GatedDeltaNet`).

    `params()` is the recurrent layer's, then `[gain, bias]`, `[W_1, b_1, W_2, b_2]`,
    `[gain, bias]` (12 in all with a GRU, an LSTM or a minGRU, as a `TransformerBlock`'s). It is
    causal and streams; its cache is the recurrent layer's state, of one size however long the
    stream.
    """

    recurrent: Recurrent | ShortConv | GatedDeltaNet
    norm1: Norm
    feed_forward: Feed
    norm2: Norm
    dropout: Dropout
    gates: "tuple[Gate, ...]"
    d_model: int = eqx.field(static=True, converter=python_scalar)
    norm_first: bool = eqx.field(static=True, converter=python_scalar)
    norm_placement: str = eqx.field(static=True, converter=python_scalar)
    output_norms: "tuple[Norm, ...]"
    remat: str | None = eqx.field(static=True, converter=python_scalar)

    def __init__(
        self, d_model: int, d_ff: int, key: PRNGKeyArray, mixer: str = "gru",
        dropout: float = 0.0, gate: bool = False, norm_first: bool = False,
        remat: str | None = None, activation: str = "relu", layer_norm_eps: float = 1e-5,
        norm: str = "layer", feed_forward: str = "mlp", norm_placement: str = "input",
        n_experts: int | None = None, top_k: int | None = None, normalize_top_k: bool = True,
        shared_d_ff: int | None = None, **mixer_options: Any,
    ):  # fmt: skip
        _check_block(key, d_model, d_ff, gate, norm_first)
        if not isinstance(mixer, str) or mixer not in MIXERS:
            raise ValueError(
                f"`mixer` of a RecurrentBlock must be one of {tuple(MIXERS)}; received "
                f"`mixer={mixer!r}`."
            )
        if mixer == "gated_deltanet" and "n_heads" not in mixer_options:
            raise TypeError("the gated_deltanet mixer needs `n_heads` (its value heads).")
        rkey, fkey = jr.split(key)
        self.recurrent = MIXERS[mixer](d_model, rkey, **mixer_options)  # type: ignore[assignment]
        self._build_around_mixer(
            d_model, d_ff, key, fkey, dropout, gate, norm_first, remat, activation,
            layer_norm_eps, norm, feed_forward, norm_placement,
            _experts(feed_forward, n_experts, top_k, normalize_top_k, shared_d_ff),
        )  # fmt: skip

    @property
    def mixer(self) -> Layer:
        return self.recurrent

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: State
    ) -> tuple[Float[Array, "K d_model"], State]:
        """`K` steps of the block at once; see the mixer's `prefill`."""
        return self._prefill(x, cache)
