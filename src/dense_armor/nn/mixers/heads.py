"""What self- and cross-attention share (Vaswani et al. 2017, "Attention Is All You Need", page 5):
`MultiHeadAttention`, the abstract base whose methods project, split into heads, rotate, group,
drop weights and choose the kernel, once for both layers; and the checks of their arguments.

A layer's `mask` is described once, in `core.Layer`; only the kernels take a mask over the
scores, `(..., T, S)`, as the attention page defines it.
"""

import math
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from ..core import CannotStream, Layer, Param, require_bool, require_positive, sees
from ..kernels.blocked import blocked_attention
from ..kernels.choice import _dot_product_attention, choose_kernel, is_exporting, older_spelling
from ..kernels.materialised import _attention, attention_weights, scaled_cache_attention
from ..kernels.paged import kernel_fits, paged_decode, rotation_tables
from ..kernels.rotary import Rotary
from ..layers.language import RMSNorm

__all__ = ["HEAD_SPLIT", "MultiHeadAttention"]


def _folded(q: Array, keys: Array, mask: Array | None) -> tuple[Array, Array | None]:
    """Queries `(n_heads, T, d)` with each key/value head's group of query heads folded into its
    query rows, `(n_kv_heads, group * T, d)`, for plain batched products (a broadcast group axis
    runs 1.25x slower), and `mask (T, S)` tiled over the group to match."""
    n_kv, group, length = keys.shape[0], q.shape[0] // keys.shape[0], q.shape[1]
    folded = q.reshape(n_kv, group * length, q.shape[2])
    if mask is not None:
        scores = (n_kv, group, length, keys.shape[1])
        mask = jnp.broadcast_to(mask, scores).reshape(n_kv, group * length, keys.shape[1])
    return folded, mask


def _check_heads(
    d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None
) -> int:
    """Check the head counts (and a head width set apart from `d_model / n_heads`); return
    `n_kv_heads` (default `n_heads`)."""
    require_positive(d_model=d_model, n_heads=n_heads)
    if head_dim is not None:
        require_positive(head_dim=head_dim)
    elif d_model % n_heads:
        raise ValueError(
            f"`d_model` must be divisible by `n_heads`; received `d_model={d_model}`, "
            f"`n_heads={n_heads}` (remainder {d_model % n_heads})."
        )
    if n_kv_heads is None:
        return n_heads
    require_positive(n_kv_heads=n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(
            f"`n_heads` must be a multiple of `n_kv_heads` (each key/value head serves a group "
            f"of query heads); received `n_heads={n_heads}`, `n_kv_heads={n_kv_heads}`."
        )
    return int(n_kv_heads)


# How tensor parallelism splits an attention layer (`Layer.tensor_parallel`): the query, key and
# value projections (and their biases) by output columns, whole heads per device; the output
# projection by rows, so each device's heads give a partial sum of the output.
HEAD_SPLIT: dict[str, tuple[int, str | None]] = {
    "W_Q": (-1, "n_heads"),
    "b_Q": (-1, "n_heads"),
    "W_K": (-1, "n_kv_heads"),
    "b_K": (-1, "n_kv_heads"),
    "W_V": (-1, "n_kv_heads"),
    "b_V": (-1, "n_kv_heads"),
    "W_O": (-2, "n_heads"),
    "W_G": (-1, "n_heads"),
}


def _heads(a: Array, n_heads: int) -> Array:
    """`(L, n_heads * d_head) -> (n_heads, L, d_head)`."""
    return a.reshape(a.shape[0], n_heads, a.shape[1] // n_heads).transpose(1, 0, 2)


def _grouped(q: Array, n_kv_heads: int) -> Array:
    """Query heads `(n_heads, T, d)` as `(n_kv_heads, group, T, d)`: query head `h` attends with
    key/value head `h // group`, and keys `(n_kv_heads, 1, S, d)` broadcast over the group, never
    repeated in memory."""
    return q.reshape(n_kv_heads, q.shape[0] // n_kv_heads, *q.shape[1:])


def _sequence_mask(
    queries: int, keys: int, causal: bool, window: int | None, key_mask: Array | None
) -> Array | None:
    """The `(T, S)` mask (or `None`) that `causal`, `window` and `key_mask (S,)` describe."""
    mask = sees(jnp.arange(queries)[:, None], jnp.arange(keys)[None, :], window) if causal else None
    if key_mask is not None:
        mask = key_mask[None, :] if mask is None else mask & key_mask[None, :]
    return mask


def _check_window(window: int | None, causal: bool) -> None:
    if window is None:
        return
    require_positive(window=window)
    if not causal:
        raise ValueError(
            f"`window={window}` restricts each step to the last `window` steps, which needs "
            "`causal=True`."
        )


def _require_causal(layer: Layer) -> None:
    if not layer.causal:
        raise CannotStream(
            f"{type(layer).__name__} was built with `causal=False`: step t of it would see later "
            "steps, so it cannot stream. Build it with `causal=True`."
        )


class MultiHeadAttention(Layer):
    """The multi-head attention that `MultiHeadSelfAttention` and `MultiHeadCrossAttention` are:
    queries `x W_Q (+ b_Q)` of one sequence against keys and values projected by `W_K`, `W_V`
    (`+ b_K`, `b_V`) from the same sequence or from a context, in `n_heads` query heads and
    `n_kv_heads` key/value heads (each serving a group of query heads), rotated by their
    positions when `rope_base` is set, joined by `W_O (+ b_O)`. Abstract: the two layers declare
    the fields and their own `forward`; everything between a projection and the output is here,
    once, with one kernel choice (`kernels.choice.choose_kernel`) for every path."""

    W_Q: eqx.AbstractVar[Param]
    W_K: eqx.AbstractVar[Param]
    W_V: eqx.AbstractVar[Param]
    W_O: eqx.AbstractVar[Param]
    b_Q: eqx.AbstractVar[Param | None]
    b_K: eqx.AbstractVar[Param | None]
    b_V: eqx.AbstractVar[Param | None]
    b_O: eqx.AbstractVar[Param | None]
    W_G: eqx.AbstractVar[Param | None]
    d_model: eqx.AbstractVar[int]
    n_heads: eqx.AbstractVar[int]
    n_kv_heads: eqx.AbstractVar[int]
    implementation: eqx.AbstractVar[str]
    rope_base: eqx.AbstractVar[float | None]
    attention_dropout: eqx.AbstractVar[float]
    head_dim: eqx.AbstractVar[int]
    rope_scaling: eqx.AbstractVar[tuple | None]
    rotary_fraction: eqx.AbstractVar[float]
    q_norm: eqx.AbstractVar[RMSNorm | None]
    k_norm: eqx.AbstractVar[RMSNorm | None]
    query_scale: eqx.AbstractVar[float | None]
    logit_softcap: eqx.AbstractVar[float | None]
    tensor_parallel: ClassVar[Mapping[str, tuple[int, str | None]]] = HEAD_SPLIT

    def _build_projections(
        self,
        key: PRNGKeyArray,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        d_source: int,
        use_bias: bool,
        d_head: int | None = None,
    ) -> None:
        """The four projections (uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in)]`, keys and values
        from `d_source` features) and their biases (zeros, as PyTorch's `nn.MultiheadAttention`
        starts them, or `None` each), from a layer's `__init__`."""
        require_bool(use_bias=use_bias)
        qkey, kkey, vkey, okey = jr.split(key, 4)

        def init(k: PRNGKeyArray, d_in: int, width: int) -> Param:
            bound = 1.0 / math.sqrt(d_in)
            return Param(jr.uniform(k, (d_in, width), minval=-bound, maxval=bound))

        d_head = d_model // n_heads if d_head is None else d_head
        q_width, kv_width = n_heads * d_head, n_kv_heads * d_head
        self.W_Q, self.W_O = init(qkey, d_model, q_width), init(okey, q_width, d_model)
        self.W_K, self.W_V = init(kkey, d_source, kv_width), init(vkey, d_source, kv_width)
        self.b_Q = Param(jnp.zeros(q_width)) if use_bias else None
        self.b_O = Param(jnp.zeros(d_model)) if use_bias else None
        self.b_K, self.b_V = (Param(jnp.zeros(kv_width)) if use_bias else None for _ in "KV")
        self.head_dim = d_head

    @property
    def d_head(self) -> int:
        """The width of a head: `d_model / n_heads`, or `head_dim` where it is set apart."""
        return self.head_dim

    @property
    def rotary(self) -> Rotary | None:
        """The layer's rotation (`None` without rotary positions)."""
        if self.rope_base is None:
            return None
        return Rotary(self.rope_base, self.d_head, self.rotary_fraction, self.rope_scaling)

    @property
    def memory_efficient(self) -> bool | None:
        """`implementation` in the older spelling: blocked (`True`), not (`False`) or by length."""
        return older_spelling(self.implementation)

    @staticmethod
    def _affine(x: Array, weight: Param, bias: Param | None) -> Array:
        y = weight.project(x)
        return y if bias is None else y + jnp.broadcast_to(bias.value.astype(y.dtype), y.shape)

    def keys_values(self, source: Array) -> tuple[Array, Array]:
        """The keys `source W_K` and values `source W_V` (plus biases), `(S, n_kv_heads *
        d_head)` each, of a sequence or a context `source (S, d_source)`."""
        keys = self._affine(source, self.W_K, self.b_K)
        if self.k_norm is not None:
            keys = self._normalised(keys, self.k_norm)
        return keys, self._affine(source, self.W_V, self.b_V)

    def _normalised(self, a: Array, norm: RMSNorm) -> Array:
        """`a (L, heads * d_head)` through a query/key norm: over each head's features (Qwen3's,
        Gemma 3's) or over the whole projection (OLMo 2's), as the norm's width says."""
        if norm.d_model == a.shape[-1]:
            return norm(a)
        heads = a.reshape(a.shape[0], a.shape[1] // norm.d_model, norm.d_model)
        return norm(heads).reshape(a.shape)

    def _query_heads(
        self, x: Array, keys: Array, positions: tuple[Array, Array] | None
    ) -> tuple[Array, Array]:
        """The queries of `x (T, d_model)` in heads `(n_heads, T, d_head)` and `keys` already in
        heads `(n_kv_heads, S, d_head)`, both rotated by their `(query, key)` positions when the
        layer has rotary positions (a whole sequence: step t at position t). Keys are cached
        unrotated."""
        queries = self._affine(x, self.W_Q, self.b_Q)
        if self.q_norm is not None:
            queries = self._normalised(queries, self.q_norm)
        if self.query_scale is not None:  # the kernels divide by sqrt(d_head): that undone here
            queries = queries * jnp.asarray(self.query_scale * math.sqrt(self.d_head), x.dtype)
        q = _heads(queries, self.n_heads)
        rotary = self.rotary
        if rotary is None:
            return q, keys
        if positions is None:
            positions = (jnp.arange(q.shape[-2]), jnp.arange(keys.shape[-2]))
        return rotary(q, positions[0]), rotary(keys, positions[1])

    def _paged(self, x: Array, pages: tuple, positions: tuple[Array, Array]) -> Array | None:
        """One step's attention over a paged cache's pool read in place by the TPU kernel
        (`kernels.paged`), joined and projected; `None` where the kernel does not apply here (the
        caller reads the gathered view). Keys are rotated in the kernel by the view's positions
        (`positions[1]`, `0..width * page_size - 1`)."""
        pool_keys, pool_values, table, window, read = pages
        if is_exporting() or self.implementation in ("xla", "cudnn"):
            return None
        if not kernel_fits(pool_keys, table.shape[-1], x.shape[0], False, read):
            return None
        length = table.shape[-1] * pool_keys.shape[2]
        q, _ = self._query_heads(x, jnp.zeros((self.n_kv_heads, 0, self.d_head), x.dtype),
                                 (positions[0], positions[1][:0]))  # fmt: skip
        rotation = rotation_tables(self.rotary, length, self.d_head)
        out = paged_decode(q[:, 0], pool_keys, pool_values, table, positions[0][0], rotation,
                           window, self.logit_softcap)  # fmt: skip
        return self._output(out[:, None], x)

    def _output(self, out: Array, x: Array) -> Array:
        """Heads `(n_heads, T, d_head)` joined to `(T, d_model)`, gated by `sigmoid(x W_G)` where
        the layer has an output gate (Qwen3.5's), and projected by `W_O`."""
        joined = out.transpose(1, 0, 2).reshape(out.shape[1], self.n_heads * self.d_head)
        if self.W_G is not None:
            gate = jax.nn.sigmoid(self.W_G.project(x, jnp.float32))
            joined = (joined.astype(jnp.float32) * gate).astype(joined.dtype)
        return self._affine(joined, self.W_O, self.b_O)

    def attend_heads(
        self,
        x: Array,
        keys: Array,
        values: Array,
        mask: Array | None,
        positions: tuple[Array, Array] | None = None,
        hidden_zeros: bool = False,
        scales: tuple[Array, Array] | None = None,
        pages: tuple | None = None,
    ) -> Array:
        """The queries of `x (T, d_model)` against `keys` and `values` already in heads
        `(n_kv_heads, S, d_head)` (a cache's), under `mask (T, S)`, with the materialised scores
        or `jax.nn.dot_product_attention` (`hidden_zeros`: see `materialised._attention`). An
        int8 cache's `scales` (keys', values', `(n_kv_heads, S)` each) go to
        `scaled_cache_attention`; a paged cache's `pages` (`KVUpdate.pages`) to the TPU's paged
        kernel where it applies (`_paged`)."""
        if pages is not None and positions is not None:
            out = self._paged(x, pages, positions)
            if out is not None:
                return out
        # Cached keys and values may be stored wider than the compute dtype (float32 for bfloat16).
        keys, values = keys.astype(x.dtype), values.astype(x.dtype)
        q, keys = self._query_heads(x, keys, positions)
        kernel = choose_kernel(self.implementation, None, None)  # lengths: not blocked here
        if scales is not None:
            return self._output(self._scaled(q, keys, values, mask, scales), x)
        if kernel in ("xla", "cudnn"):  # jax.nn takes fewer key/value heads itself
            out = _dot_product_attention(q, keys, values, mask, kernel)
        elif keys.shape[0] == q.shape[0]:  # a key/value head per query head: no group axis, whose
            # broadcast in the products XLA's CPU compiler runs 2.5x slower
            out = _attention(q, keys, values, mask, hidden_zeros, self.logit_softcap)
        else:  # grouped-query attention: each key/value head's group folded (`_folded`)
            folded, mask = _folded(q, keys, mask)
            out = _attention(folded, keys, values, mask, hidden_zeros, self.logit_softcap)
            out = out.reshape(q.shape)
        return self._output(out, x)

    def _scaled(
        self, q: Array, keys: Array, values: Array, mask: Array | None, scales: tuple[Array, Array]
    ) -> Array:
        """`q (n_heads, T, d)` over an int8 cache's rows, each key/value head's group of query
        heads folded into its query rows (`_folded`)."""
        folded, mask = _folded(q, keys, mask)
        key_scales, value_scales = scales
        out = scaled_cache_attention(
            folded, keys, values, mask, key_scales, value_scales, self.logit_softcap
        )
        return out.reshape(q.shape)

    def attend_sequence(
        self,
        x: Array,
        keys: Array,
        values: Array,
        key_mask: Array | None,
        causal: bool = False,
        window: int | None = None,
    ) -> Array:
        """Every row of `x (T, d_model)` against projected `keys` and `values` `(S, n_kv_heads *
        d_head)`, under the mask that `causal`, `window` and `key_mask (S,)` describe: in blocks
        (`blocked_attention`, the mask never materialised) when the kernel choice says so, else
        through `attend_heads`."""
        length, key_length = x.shape[0], keys.shape[0]
        keys, values = _heads(keys, self.n_kv_heads), _heads(values, self.n_kv_heads)
        if choose_kernel(self.implementation, length, key_length) != "blocked":
            mask = _sequence_mask(length, key_length, causal, window, key_mask)
            return self.attend_heads(x, keys, values, mask)
        q, keys = self._query_heads(x, keys, None)
        keys, values = keys[:, None].astype(x.dtype), values[:, None].astype(x.dtype)
        out = blocked_attention(
            _grouped(q, self.n_kv_heads),
            keys,
            values,
            causal=causal,
            window=window,
            key_mask=key_mask,
        )
        return self._output(out.reshape(q.shape), x)

    def weights(self, x: Array, keys: Array, mask: Array | None) -> Array:
        """The attention weights `(n_kv_heads, group, T, S)` in float32 of the queries of `x`
        against projected `keys (S, n_kv_heads * d_head)` under `mask (T, S)`."""
        q, k = self._query_heads(x, _heads(keys, self.n_kv_heads), None)
        grouped = _grouped(q, self.n_kv_heads)
        return attention_weights(grouped, k[:, None], mask, self.logit_softcap)

    def attend_dropping_weights(
        self, x: Array, keys: Array, values: Array, mask: Array | None, key: PRNGKeyArray
    ) -> Array:
        """Attention with dropout on its weights (PyTorch's `dropout` of `nn.MultiheadAttention`):
        the weights of `x`'s queries against projected `keys` and `values` `(S, n_kv_heads *
        d_head)` are materialised, each dropped with probability `attention_dropout` and the
        others scaled by `1 / (1 - attention_dropout)`."""
        rate = self.attention_dropout
        weights = self.weights(x, keys, mask)
        keep = jax.random.bernoulli(key, 1.0 - rate, weights.shape)
        scale = 0.0 if rate == 1.0 else 1.0 / (1.0 - rate)  # every weight dropped: zeros, not 0/0
        weights = jnp.where(keep, weights * scale, 0.0)
        v = _heads(values, self.n_kv_heads).astype(jnp.float32)
        out = jnp.einsum("kgts,ksd->kgtd", weights, v)
        return self._output(out.reshape(self.n_heads, *out.shape[2:]).astype(x.dtype), x)
