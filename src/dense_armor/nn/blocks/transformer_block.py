"""The Transformer encoder block (Vaswani et al. 2017, page 3): `MixerBlock`'s equations around a
`MultiHeadSelfAttention`."""

from typing import Any

import equinox as eqx
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import python_scalar, shape_checked
from ..layers.basic import Dropout
from ..mixers.heads import _check_heads
from ..mixers.options import attention_options
from ..mixers.self_attention import MultiHeadSelfAttention
from ..state.cache import FixedKVCache, KVCache, RingKVCache
from ..state.paged import PagedKVCache
from .mixer_block import Feed, Gate, MixerBlock, Norm, _check_block

__all__ = ["TransformerBlock"]


def _experts(
    feed_forward: str,
    n_experts: int | None,
    top_k: int | None,
    normalize: bool,
    shared_d_ff: int | None = None,
) -> dict[str, Any] | None:
    """A mixture of experts' options: both counts with `feed_forward="moe"` (and a shared
    expert's width if any), none of them without."""
    given = n_experts is not None or top_k is not None or shared_d_ff is not None
    if feed_forward != "moe":
        if given:
            raise ValueError(
                "`n_experts`, `top_k` and `shared_d_ff` are the options of "
                f"`feed_forward='moe'`; received them with `feed_forward={feed_forward!r}`."
            )
        return None
    if n_experts is None or top_k is None:
        raise ValueError("`feed_forward='moe'` needs `n_experts` and `top_k` (the experts chosen).")
    options = {"n_experts": n_experts, "top_k": top_k, "normalize_top_k": normalize}
    return options if shared_d_ff is None else {**options, "shared_d_ff": shared_d_ff}


class TransformerBlock(MixerBlock):
    """The post-LayerNorm Transformer block (Vaswani et al. 2017, page 3 and Eq.(2), page 5).

    `y = LayerNorm(x + Dropout(Attention(x)))`, then `z = LayerNorm(y + Dropout(FFN(y)))`.

    **Arguments:** `d_model`, `n_heads`, `d_ff` (the hidden width of the feed-forward), `key`,
    `causal=False`, `dropout=0.0` (applied to each sub-layer's output before the residual addition,
    only when `forward` gets a `key`), `gate=False` (a `Gate` replaces each residual addition: `y =
    LayerNorm(Gate(x, Attention(x)))`, ...), `norm_first=False` (pre-LN instead: `y = x +
    Attention(LayerNorm(x))`, `z = y + FFN(LayerNorm(y))`, Xiong et al. 2020), `remat=None`
    (`"block"`: the block's activations are recomputed in the backward pass instead of stored,
    `jax.checkpoint`; `"attention"`: only the attention's, whose `(n_heads, T, T)` scores are most
    of them), and as PyTorch's layers: `activation="relu"` (or `"gelu"`, of the feed-forward;
    `"gelu_tanh"`, `"silu"`) and `layer_norm_eps=1e-5`; `norm="layer"` (or `"rms"`: `RMSNorm`,
    Llama's, `layer_norm_eps` its eps; `"rms_plus_one"`: Gemma's, scaled by `1 + w`),
    `feed_forward="mlp"` (or `"gated"`: `GatedFeedForward`, SwiGLU with `activation="silu"`) and,
    with `norm_first=True`, `norm_placement="input"` (or `"output"`: each sub-layer's output is
    normalised before the residual addition and its input is not, OLMo 2's `x + Norm(Sub(x))`;
    `"both"`: `x + Norm'(Sub(Norm(x)))`, Gemma 2/3's four norms per block); `feed_forward="moe"`
    with `n_experts`, `top_k` and `normalize_top_k=True` is a `MixtureOfExperts` of SwiGLU experts
    `d_ff` wide (Mixtral's, Qwen3-MoE's), with `shared_d_ff=None` the width of a gated shared
    expert (Qwen3.5-MoE's). Every other keyword
    is an option of the attention (`**attention`, `mixers.options.ATTENTION_OPTIONS`), passed to
    its `MultiHeadSelfAttention` as given: `window=None` (sliding-window attention),
    `implementation=None` (how the scores are computed) and its older spelling
    `memory_efficient=None`, `n_kv_heads=None` (grouped-query attention), `rope_base=None`
    (rotary positions), `use_bias=False` (biases on the projections), `attention_dropout=0.0` (on
    the attention weights) and the checkpoints' options (`head_dim`, `rope_scaling`, `qk_norm`,
    ...: see `MultiHeadSelfAttention`).

    `forward(x, mask=None)`, `mask` the padding mask of `Layer`.

    `params()` is, in order, the attention's `[W_Q, W_K, W_V, W_O]`, the first LayerNorm's
    `[gain, bias]`, the feed-forward's `[W_1, b_1, W_2, b_2]` and the second LayerNorm's
    `[gain, bias]`: 12 in all; then, with `gate=True`, each gate's `[U, W, b]` (18 in all).
    A causal block streams like `MultiHeadSelfAttention`.
    """

    attention: MultiHeadSelfAttention
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
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        key: PRNGKeyArray,
        causal: bool = False,
        dropout: float = 0.0,
        gate: bool = False,
        norm_first: bool = False,
        remat: str | None = None,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
        norm: str = "layer",
        feed_forward: str = "mlp",
        norm_placement: str = "input",
        n_experts: int | None = None,
        top_k: int | None = None,
        normalize_top_k: bool = True,
        shared_d_ff: int | None = None,
        **attention: Any,
    ):
        _check_block(key, d_model, d_ff, gate, norm_first)
        _check_heads(d_model, n_heads, head_dim=attention.get("head_dim"))
        options = attention_options("TransformerBlock", attention)
        akey, fkey = jr.split(key)
        self.attention = MultiHeadSelfAttention(d_model, n_heads, akey, causal=causal, **options)
        self._build_around_mixer(
            d_model, d_ff, key, fkey, dropout, gate, norm_first, remat, activation,
            layer_norm_eps, norm, feed_forward, norm_placement,
            _experts(feed_forward, n_experts, top_k, normalize_top_k, shared_d_ff),
        )  # fmt: skip

    @property
    def mixer(self) -> MultiHeadSelfAttention:
        return self.attention

    @shape_checked
    def attention_weights(
        self, x: Float[Array, "T d_model"], *, mask: Bool[Array, " T"] | None = None
    ) -> Float[Array, "n_heads T T"]:
        """The weights `(n_heads, T, T)` of the block's attention on the input `x`."""
        on_input = self.norm_first and self.norm_placement != "output"
        return self.attention.attention_weights(self.norm1(x) if on_input else x, mask=mask)

    @shape_checked
    def prefill(
        self,
        x: Float[Array, "K d_model"],
        cache: KVCache | FixedKVCache | RingKVCache | PagedKVCache,
    ) -> tuple[Float[Array, "K d_model"], KVCache | FixedKVCache | RingKVCache | PagedKVCache]:
        """`K` causal steps of the block at once; see `MultiHeadSelfAttention.prefill`."""
        return self._prefill(x, cache)
