"""`TransformerLM`: a decoder-only language model, token ids `(T,)` to logits `(T, vocab)`, in
the two lineages of the checkpoints it loads: GPT-2 (learned positions, LayerNorm, the MLP with
GPT-2's tanh GELU, biases, a tied head) and Llama / Qwen2 (rotary positions, RMSNorm, SwiGLU,
grouped-query attention, an untied or tied head, Qwen2's query/key/value biases)."""

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import precision
from ..blocks.mixer_block import Norm
from ..blocks.recurrent_block import RecurrentBlock
from ..blocks.transformer_block import TransformerBlock
from ..core import (
    Layer,
    python_scalar,
    shape_checked,
)
from ..layers.language import Embedding, LMHead
from ..layers.positions import LearnedPositions
from ..mixers.options import attention_options
from ..state.cache import PositionCache
from ..state.counter import Counter
from ..state.streams import batch_streams
from .language_options import (
    check_softcap,
    context_length,
    layer_options_checked,
    longrope_limit,
)  # fmt: skip
from .language_parts import LM_POSITIONS, check_arguments, lm_blocks, lm_parts, stored
from .sequential import Sequential
from .stack import Stack, scanned

__all__ = ["LM_POSITIONS", "TransformerLM", "longrope_limit"]


class TransformerLM(Layer):
    """A decoder-only, pre-LN Transformer language model: `Embedding`, learned positions (GPT-2)
    or rotary ones inside every attention (Llama), `depth` causal `TransformerBlock`s, a final
    norm and the head: `Embedding.attend` (tied) or an `LMHead`.

    **Arguments:** `vocab`, `d_model`, `n_heads`, `d_ff`, `depth`, `key`, `max_len` (the longest
    sequence the model is made for, its `context`: the learned positions' rows, or a rotary
    model's context, an imported checkpoint's `max_position_embeddings`; `generate` and the
    `Server` refuse requests past it, while a stream's cache may go on past it up to its
    capacity); then `positions="rope"` (or `"learned"`), `rope_base=10000.0`, `norm="rms"` (or
    `"layer"`), `feed_forward="gated"` (or `"mlp"`), `activation="silu"` (`"gelu_tanh"` for
    GPT-2's MLP), `eps=1e-6` (every norm's), `tie_embeddings=True`, `scan_layers=False` (the
    blocks in one `Stack`), `remat=None`, `on_invalid="raise"` (`Embedding`'s rule for ids outside
    the vocabulary), with `feed_forward="moe"` the mixture of experts' `n_experts`, `top_k`,
    `normalize_top_k` and `shared_d_ff` (see `TransformerBlock`) and, as for every block, the
    attention's options (`**attention`:
    `n_kv_heads`, `use_bias`, `window`, `implementation`, ...). `mixers` (one name per block,
    default all `"attention"`) makes a hybrid: a block named otherwise is a `RecurrentBlock`
    around that mixer (`"short_conv"`: LFM2's, `"gated_deltanet"`: Qwen3.5's, or a classic
    recurrent layer) with the same norms and feed-forward, its options in `mixer_options[name]`;
    its state is its cache, beside the attention blocks' keys and values. The defaults are Llama's;
    GPT-2 is `positions="learned", norm="layer", feed_forward="mlp", activation="gelu_tanh",
    eps=1e-5, use_bias=True`.

    `forward(ids)` gives the logits of every position; it streams: `init_cache(capacity)`, then
    `prefill(ids, cache)` over a prompt and `step(id, cache)` one token at a time, each giving the
    logits of its positions; `init_streams(batch, capacity)` and `reset` for a batch of streams.
    """

    embed: Embedding
    positions: LearnedPositions | None
    blocks: tuple[TransformerBlock | RecurrentBlock | Stack | Sequential, ...] | Stack
    norm: Norm
    head: LMHead | None
    vocab: int = eqx.field(static=True, converter=python_scalar)
    d_model: int = eqx.field(static=True, converter=python_scalar)
    embed_scale: bool = eqx.field(static=True, converter=python_scalar, default=False)
    final_logit_softcap: float | None = eqx.field(
        static=True, converter=python_scalar, default=None
    )
    position_limit: int | None = eqx.field(static=True, converter=python_scalar, default=None)
    context: int = eqx.field(static=True, converter=python_scalar, default=0)
    compute_dtype: str | None = eqx.field(static=True, converter=python_scalar, default=None)
    causal: ClassVar[bool] = True

    def __init__(
        self,
        vocab: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        depth: int,
        key: PRNGKeyArray,
        max_len: int,
        *,
        positions: str = "rope",
        rope_base: float = 10000.0,
        norm: str = "rms",
        feed_forward: str = "gated",
        activation: str = "silu",
        eps: float = 1e-6,
        tie_embeddings: bool = True,
        scan_layers: bool = False,
        remat: str | None = None,
        on_invalid: str = "raise",
        norm_placement: str = "input",
        embed_scale: bool = False,
        final_logit_softcap: float | None = None,
        layer_options: Sequence[Mapping[str, Any]] | None = None,
        n_experts: int | None = None,
        top_k: int | None = None,
        normalize_top_k: bool = True,
        shared_d_ff: int | None = None,
        param_dtype: str = "float32",
        compute_dtype: str | None = None,
        quantize: str | None = None,
        quantize_embeddings: bool = False,
        mixers: Sequence[str] | None = None,
        mixer_options: Mapping[str, Mapping[str, Any]] | None = None,
        **attention: Any,
    ):
        check_arguments(key, vocab, d_model, depth, max_len, positions, tie_embeddings,
                        scan_layers, embed_scale, param_dtype, compute_dtype, quantize,
                        quantize_embeddings)  # fmt: skip
        options = attention_options("TransformerLM", attention)
        options["rope_base"] = rope_base if positions == "rope" else None
        per_layer = layer_options_checked(layer_options, depth, positions)
        embed_key, position_key, head_key, *block_keys = jr.split(key, 3 + depth)
        block: dict[str, Any] = dict(  # what every block takes
            causal=True, norm_first=True, remat=remat, activation=activation, layer_norm_eps=eps,
            norm=norm, feed_forward=feed_forward, norm_placement=norm_placement,
            n_experts=n_experts, top_k=top_k, normalize_top_k=normalize_top_k,
            shared_d_ff=shared_d_ff)  # fmt: skip
        blocks = lm_blocks(d_model, n_heads, d_ff, block_keys, block, options, per_layer, mixers,
                           mixer_options)  # fmt: skip
        parts = lm_parts(
            vocab, d_model, max_len, (embed_key, position_key, head_key), positions, norm, eps,
            tie_embeddings, on_invalid, scanned(blocks) if scan_layers else blocks,
        )  # fmt: skip
        for name, part in stored(parts, param_dtype, quantize, quantize_embeddings).items():
            setattr(self, name, part)
        self.compute_dtype, self.vocab, self.d_model = compute_dtype, vocab, d_model
        self.embed_scale, self.final_logit_softcap = embed_scale, check_softcap(final_logit_softcap)
        self.position_limit = longrope_limit(options, per_layer)
        self.context = context_length(max_len, options, per_layer)

    @property
    def positions_end(self) -> int | None:
        """Where the model's positions end: the learned table's `max_len`, LongRoPE's pretrained
        length (`position_limit`), or None (rotary positions go on)."""
        return self.position_limit if self.positions is None else self.positions.max_len

    def _check_length(self, ids: Array, caller: str) -> None:
        limit = self.position_limit
        if limit is not None and isinstance(ids.shape[0], int) and ids.shape[0] > limit:
            raise ValueError(
                f"TransformerLM.{caller}: {ids.shape[0]} positions pass this model's LongRoPE "
                f"pretrained length ({limit}), past which it is not built (`position_limit`)."
            )

    def _embedded(self, ids: Array) -> Array:
        """The ids' rows of the table, times `sqrt(d_model)` with `embed_scale` (Gemma's)."""
        h = self.embed(ids)
        if self.compute_dtype is not None:
            h = h.astype(self.compute_dtype)
        if self.embed_scale:
            h = h * jnp.asarray(math.sqrt(self.d_model), h.dtype)
        return h

    def _logits(self, h: Array) -> Array:
        h = self.norm(h)
        logits = self.embed.attend(h) if self.head is None else self.head(h)
        if self.final_logit_softcap is not None:  # Gemma 2's final soft-capping
            cap = self.final_logit_softcap
            logits = (jnp.tanh(logits.astype(jnp.float32) / cap) * cap).astype(logits.dtype)
        return logits

    @shape_checked
    def forward(
        self, ids: Int[Array, " T"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "T vocab"]:
        """The logits `(T, vocab)` of the next token after each position of `ids (T,)`."""
        self._check_length(ids, "forward")
        h = self._embedded(ids)
        if self.positions is not None:
            h = self.positions(h)
        if isinstance(self.blocks, Stack):
            h = self.blocks(h, key=key)
        else:
            keys = [None] * len(self.blocks) if key is None else jr.split(key, len(self.blocks))
            for block, block_key in zip(self.blocks, keys, strict=True):
                h = block(h, key=block_key)
        return self._logits(h)

    def forward_routed(self, ids: Int[Array, " T"]) -> tuple[Array, Array]:
        """`forward(ids)` of a mixture-of-experts model, and every layer's router logits
        `(depth, T, n_experts)` (for `experts.balance_loss`)."""
        self._check_length(ids, "forward_routed")
        h = self._embedded(ids)
        if self.positions is not None:
            h = self.positions(h)
        routers = []
        for item in self.blocks if isinstance(self.blocks, tuple) else (self.blocks,):
            blocks = (TransformerBlock, RecurrentBlock)
            if isinstance(item, Stack) and isinstance(item.stacked, blocks):
                h, logits = item._scan(lambda h, xs: xs[0].forward_routed(h), h, None)
            elif isinstance(item, blocks):
                h, logits = item.forward_routed(h)
                logits = logits[None]
            else:
                raise ValueError(
                    "forward_routed: a model scanned over groups of different layers has no "
                    "router logits to give; build it with `scan_layers=False`."
                )
            routers.append(logits)
        return self._logits(h), jnp.concatenate(routers)

    def init_cache(
        self,
        capacity: int | None = None,
        *,
        on_overflow: str = "raise",
        kv_dtype: str | None = None,
    ) -> Any:
        """`(positions' cache, the blocks' caches)`: a growing cache, or fixed with `capacity`;
        `kv_dtype` stores the keys and values in a dtype (`precision.KV_DTYPES`: `"int8"` with
        a scale per head and position, fixed caches only); by default, the dtype of the keys and
        values the model computes (`kv_dtype_written`: bfloat16 for a bfloat16 model, whose
        cache in float32 would hold the same values in twice the bytes), else float32.
        Without a positional table the positions' cache is a plain step counter: the index of
        the next token, which a model whose layers all keep windows in rings would otherwise hold
        nowhere (what an exported `sample_step` reads to fold its key); its limit is
        `position_limit` (a step past it fails as `on_overflow` says), else none."""
        position_cache = (
            PositionCache(Counter.start(on_overflow, self.position_limit))
            if self.positions is None
            else self.positions.init_cache(capacity, on_overflow=on_overflow)
        )
        if isinstance(self.blocks, Stack):
            blocks = self.blocks.init_cache(capacity, on_overflow=on_overflow)
        else:
            blocks = tuple(b.init_cache(capacity, on_overflow=on_overflow) for b in self.blocks)
        kv_dtype = self.kv_dtype_written() if kv_dtype is None else kv_dtype
        return (position_cache, precision.cache_in(blocks, kv_dtype))

    def kv_dtype_written(self) -> str | None:
        """The dtype of the keys and values the model writes into its caches, where narrower
        than float32: its activations' (`param_dtype`'s, or `compute_dtype`), `"bfloat16"` or
        `"float16"`; None for float32. Its caches' default: every key and value is a value of
        that dtype, so a wider cache would only take more memory and a conversion per read."""
        ids = jax.ShapeDtypeStruct((1,), jnp.int32)
        name = jnp.dtype(jax.eval_shape(self._embedded, ids).dtype).name
        return name if name in ("bfloat16", "float16") else None

    def init_streams(
        self,
        batch: int,
        capacity: int | None = None,
        *,
        on_overflow: str = "raise",
        kv_dtype: str | None = None,
    ) -> tuple:
        """`init_cache(capacity)` for `batch` streams: every array with a leading batch axis,
        for `jax.vmap(model.step)(ids, caches)`; `reset` returns chosen streams to the start."""
        cache = self.init_cache(capacity, on_overflow=on_overflow, kv_dtype=kv_dtype)
        return batch_streams(cache, batch)

    @shape_checked
    def prefill(self, ids: Int[Array, " K"], cache: tuple) -> tuple[Float[Array, "K vocab"], tuple]:
        """`K` tokens at once: their logits `(K, vocab)`, and the cache after them."""
        h, cache = self._prefill_hidden(ids, cache)
        return self._logits(h), cache

    @shape_checked
    def prefill_last(
        self, ids: Int[Array, " K"], cache: tuple
    ) -> tuple[Float[Array, " vocab"], tuple]:
        """`prefill`, but only the logits after the last of the `K` tokens, `(vocab,)`: what
        generation needs of a prompt, without the head's product at every other position (at
        GPT-2's vocabulary, about a third of the work of a 32-token prompt's prefill)."""
        if ids.shape[0] == 0:
            raise ValueError(
                "TransformerLM.prefill_last: received no tokens (`ids.shape=(0,)`): there is no "
                "last token to give the logits after. Use `prefill` for a chunk that may be empty."
            )
        h, cache = self._prefill_hidden(ids, cache)
        return self._logits(h[-1:])[0], cache

    def _prefill_hidden(self, ids: Array, cache: tuple) -> tuple[Array, tuple]:
        """The last block's output `(K, d_model)` for `K` tokens, and the cache after them."""
        position_cache, block_caches = cache
        h = self._embedded(ids)
        if self.positions is not None:
            h, position_cache = self.positions.prefill(h, position_cache)
        else:
            _, fits, counter = position_cache.counter.advance(ids.shape[0])
            if self.position_limit is not None:  # else nothing to guard (and no callback)
                message = f"TransformerLM: a step past its position_limit={self.position_limit}"
                h = counter.guard(h, fits, message)
            position_cache = PositionCache(counter)
        if isinstance(self.blocks, Stack):
            h, block_caches = self.blocks.prefill(h, block_caches)
        else:
            new = []
            for block, block_cache in zip(self.blocks, block_caches, strict=True):
                h, block_cache = block.prefill(h, block_cache)
                new.append(block_cache)
            block_caches = tuple(new)
        return h, (position_cache, block_caches)
