"""`TransformerDecoder`, the sequence-to-sequence model that attends to a context, and its
factory `transformer_decoder`, next to `transformer_encoder` in `models`."""

from typing import Any, ClassVar

import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from ..blocks.decoder_block import TransformerDecoderBlock
from ..core import Layer, check_steps, require_bool, require_key, require_positive
from ..layers.basic import Dense, LayerNorm
from ..layers.positions import PositionalEncoding
from ..mixers.options import attention_options
from ..state.counter import validate_overflow_mode
from .inputs import _positions, _rope_base
from .stack import Stack

__all__ = ["TransformerDecoder", "transformer_decoder"]


class TransformerDecoder(Layer):
    """A sequence-to-sequence decoder that attends to a context: `(T, n_in), (S, d_context) ->
    (T, n_out)`.

    `Dense(n_in, d_model)`, the positions, `depth` `TransformerDecoderBlock`s, `Dense(d_model,
    n_out)` applied to every step. Built by `transformer_decoder`. Streaming:
    `cache = decoder.init_cache(context, capacity)` projects the context once per block, then
    `y_t, cache = decoder.step(x_t, cache)` gives row `t` of `forward`.
    """

    embed: Dense
    positions: PositionalEncoding | None  # None: rotary positions, inside the attention
    blocks: tuple[Layer, ...]  # TransformerDecoderBlocks, or one Stack of them
    head: Dense
    final_norm: LayerNorm | None = None  # pre-LN blocks end with one more LayerNorm
    causal: ClassVar[bool] = True
    layers_field: ClassVar[str | None] = "blocks"

    def forward(
        self,
        x: Array,
        context: Array,
        *,
        context_mask: Array | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        keys = [None] * len(self.blocks) if key is None else list(jr.split(key, len(self.blocks)))
        h = self.embed(x)
        h = h if self.positions is None else self.positions(h)
        for block, block_key in zip(self.blocks, keys, strict=True):
            h = block(h, context, context_mask=context_mask, key=block_key)
        return self._out(h)

    def _out(self, h: Array) -> Array:
        return self.head(h if self.final_norm is None else self.final_norm(h))

    def init_cache(
        self,
        context: Array,
        capacity: int | None = None,
        *,
        context_mask: Array | None = None,
        on_overflow: str = "raise",
    ) -> tuple[Any, ...]:
        """`(positions' cache, each block's DecoderCache...)`."""
        validate_overflow_mode(on_overflow)
        return (
            None
            if self.positions is None
            else self.positions.init_cache(capacity, on_overflow=on_overflow),
            *(
                block.init_cache(
                    context, capacity, context_mask=context_mask, on_overflow=on_overflow
                )
                for block in self.blocks
            ),
        )

    def check_step(self, x_t: Any, cache: Any) -> None:
        """`step`'s own check: `x_t` one step of width `n_in`."""
        check_steps("TransformerDecoder.step", "x_t", x_t, self.embed.n_in, one_step=True)

    def prefill(self, x: Array, cache: tuple[Any, ...]) -> tuple[Array, tuple[Any, ...]]:
        """`K` steps at once, `x (K, n_in)`: what `K` calls of `step` return, stacked."""
        if not isinstance(cache, tuple) or len(cache) != 1 + len(self.blocks):
            raise ValueError(
                f"TransformerDecoder.step: expected the tuple of {1 + len(self.blocks)} caches "
                "from `init_cache(context, ...)`."
            )
        check_steps("TransformerDecoder.prefill", "x", x, self.embed.n_in, one_step=False)
        h, position_cache = self.embed(x), cache[0]
        if self.positions is not None:
            h, position_cache = self.positions.prefill(h, position_cache)
        new: list[Any] = [position_cache]
        for block, block_cache in zip(self.blocks, cache[1:], strict=True):
            h, block_cache = block.prefill(h, block_cache)
            new.append(block_cache)
        return self._out(h), tuple(new)


def transformer_decoder(
    n_in: int,
    d_model: int,
    n_heads: int,
    d_ff: int,
    depth: int,
    n_out: int,
    key: PRNGKeyArray,
    max_len: int,
    d_context: int | None = None,
    dropout: float = 0.0,
    gate: bool = False,
    positions: str = "sinusoidal",
    norm_first: bool = False,
    scan_layers: bool = False,
    remat: str | None = None,
    rope_base: float = 10000.0,
    activation: str = "relu",
    layer_norm_eps: float = 1e-5,
    **attention: Any,
) -> TransformerDecoder:
    """A decoder next to `transformer_encoder`: arguments in the same order, then `d_context`
    (default `d_model`), `dropout`, `gate` (gated residuals in every block), `positions`,
    `norm_first` (pre-LN blocks, then a final `LayerNorm` before the head), `scan_layers`,
    `remat`, `rope_base`, `activation` and `layer_norm_eps` (as in `transformer_encoder`); every
    other keyword is an option of every attention (`**attention`, as in `transformer_encoder`;
    `window`, sliding-window self-attention in every block, makes the sinusoidal positions
    unbounded, so the decoder streams forever)."""
    require_key(key)
    require_positive(
        n_in=n_in, d_model=d_model, d_ff=d_ff, depth=depth, n_out=n_out, max_len=max_len
    )
    options = attention_options("transformer_decoder", attention)
    options["rope_base"] = _rope_base(positions, rope_base)
    in_key, pos_key, out_key, *block_keys = jr.split(key, 3 + depth)
    blocks = tuple(
        TransformerDecoderBlock(
            d_model,
            n_heads,
            d_ff,
            k,
            d_context=d_context,
            dropout=dropout,
            gate=gate,
            norm_first=norm_first,
            remat=remat,
            activation=activation,
            layer_norm_eps=layer_norm_eps,
            **options,
        )
        for k in block_keys
    )
    require_bool(scan_layers=scan_layers)
    return TransformerDecoder(
        Dense(n_in, d_model, in_key),
        _positions(positions, max_len, d_model, pos_key, attention.get("window")),
        (Stack(blocks),) if scan_layers else blocks,
        Dense(d_model, n_out, out_key),
        LayerNorm(d_model, layer_norm_eps) if norm_first else None,
    )
