"""`RecurrentBlock`: the block structure of `MixerBlock` around a recurrent layer, to stack alone
or beside `TransformerBlock`s (`transformer_encoder(..., mixers=...)`)."""

import equinox as eqx
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..core import python_scalar, shape_checked
from ..layers.basic import Dropout, FeedForward, LayerNorm
from ..mixers.recurrent import RECURRENT, HiddenState, LSTMState, Recurrent
from .mixer_block import Gate, MixerBlock, _check_block

__all__ = ["RecurrentBlock"]


class RecurrentBlock(MixerBlock):
    """The block of `TransformerBlock` with a recurrent layer in place of the attention:
    `y = LayerNorm(x + Dropout(Recurrent(x)))`, then `z = LayerNorm(y + Dropout(FFN(y)))`.

    **Arguments:** `d_model`, `d_ff`, `key`, `mixer="gru"` (`"gru"`, `"lstm"` or `"mingru"`: a
    `GRU`, `LSTM` or `MinGRU` of `d_model` inputs and `d_model` hidden units), and as in
    `TransformerBlock`: `dropout=0.0`, `gate=False`, `norm_first=False`, `remat=None` (`"block"`,
    or `"attention"`, which here recomputes the recurrent layer: one option serves a stack that
    mixes both kinds of block), `activation="relu"` and `layer_norm_eps=1e-5`.

    `params()` is the recurrent layer's four, then `[gain, bias]`, `[W_1, b_1, W_2, b_2]`,
    `[gain, bias]`: 12 in all, as a `TransformerBlock`'s. It is causal and streams; its cache is
    the recurrent layer's state, of one size however long the stream.
    """

    recurrent: Recurrent
    norm1: LayerNorm
    feed_forward: FeedForward
    norm2: LayerNorm
    dropout: Dropout
    gates: "tuple[Gate, ...]"
    d_model: int = eqx.field(static=True, converter=python_scalar)
    norm_first: bool = eqx.field(static=True, converter=python_scalar)
    norm_placement: str = eqx.field(static=True, converter=python_scalar)
    output_norms: "tuple[LayerNorm, ...]"
    remat: str | None = eqx.field(static=True, converter=python_scalar)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        key: PRNGKeyArray,
        mixer: str = "gru",
        dropout: float = 0.0,
        gate: bool = False,
        norm_first: bool = False,
        remat: str | None = None,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
    ):
        _check_block(key, d_model, d_ff, gate, norm_first)
        if mixer not in RECURRENT:
            raise ValueError(
                f"`mixer` of a RecurrentBlock must be one of {tuple(RECURRENT)}; received "
                f"`mixer={mixer!r}`."
            )
        rkey, fkey = jr.split(key)
        self.recurrent = RECURRENT[mixer](d_model, d_model, rkey)
        self._build_around_mixer(
            d_model, d_ff, key, fkey, dropout, gate, norm_first, remat, activation, layer_norm_eps
        )

    @property
    def mixer(self) -> Recurrent:
        return self.recurrent

    @shape_checked
    def prefill(
        self, x: Float[Array, "K d_model"], cache: HiddenState | LSTMState
    ) -> tuple[Float[Array, "K d_model"], HiddenState | LSTMState]:
        """`K` steps of the block at once; see `Recurrent.prefill`."""
        return self._prefill(x, cache)
