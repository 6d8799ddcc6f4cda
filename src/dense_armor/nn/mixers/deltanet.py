"""`GatedDeltaNet`: the gated delta rule (Yang, Kautz and Hatamizadeh 2025, "Gated Delta
Networks"), Qwen3.5's linear-attention layer, on the streaming protocol.

Each value head keeps a matrix memory `S (key_dim, value_dim)`. A step decays it by `exp(g)`,
reads what it predicts for the key, writes the correction (the delta rule) with the rate `beta`,
and reads the query: `S = exp(g) S`, `S = S + k (beta (v - S^T k))^T`, `o = S^T q`. That memory
is the layer's cache, with the state of the short convolution in front of it: one size however
long the stream.

`forward` and `prefill` compute a sequence in chunks of `chunk` steps (the WY form of the delta
rule: within a chunk, the inverse of a unit lower-triangular matrix and products; across chunks,
a scan of the memory), and
`step` in the recurrent form; they agree to float32 round-off. The chunk's work grows as its
square (and its inverse's as its cube), the scan's steps as its inverse: on XLA's CPU a layer of
Qwen3.5's heads (8 of 128, 4096 steps) took 257 ms in chunks of 16 or 32, 290 in chunks of 64 and
410 in chunks of 128 (4 heads of 64 over 8192 steps: 83-89, 139, 253 ms), so 32 is the default.
A sequence of symbolic length (under `jax.export`) runs in the recurrent form.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..core import (
    Param,
    ShapeError,
    python_scalar,
    require_key,
    require_positive,
)
from ..layers.language import require_eps
from ..state.counter import validate_overflow_mode
from .convolution import ConvState, causal_conv, check_conv_state, conv_state
from .stateful import StatefulMixer

__all__ = ["DeltaState", "GatedDeltaNet", "delta_rule_chunked", "delta_rule_recurrent"]


class DeltaState(eqx.Module):
    """A `GatedDeltaNet`'s state: its convolution's last inputs and every head's memory
    `(n_heads, key_dim, value_dim)`, float32."""

    conv: ConvState
    memory: Float[Array, "n_heads key_dim value_dim"]


def delta_rule_recurrent(
    q: Array, k: Array, v: Array, beta: Array, g: Array, memory: Array
) -> tuple[Array, Array]:
    """The gated delta rule one step at a time: `q, k (T, H, dk)`, `v (T, H, dv)`, `beta, g (T,
    H)`, `memory (H, dk, dv)`; every step's output `(T, H, dv)` and the memory after them."""

    def tick(s: Array, step: tuple[Array, ...]) -> tuple[Array, Array]:
        q_t, k_t, v_t, b_t, g_t = step
        s = s * jnp.exp(g_t)[:, None, None]
        predicted = jnp.einsum("hkv,hk->hv", s, k_t)
        s = s + k_t[:, :, None] * ((v_t - predicted) * b_t[:, None])[:, None, :]
        return s, jnp.einsum("hkv,hk->hv", s, q_t)

    memory, out = jax.lax.scan(tick, memory, (q, k, v, beta, g))
    return out, memory


def delta_rule_chunked(
    q: Array, k: Array, v: Array, beta: Array, g: Array, memory: Array, chunk: int
) -> tuple[Array, Array]:
    """`delta_rule_recurrent` in chunks of `chunk` steps (the WY form): within a chunk the
    steps' updates are one unit lower-triangular inverse and products; a scan carries the memory
    from chunk to chunk. Padded steps (`beta = 0`, `g = 0`) change nothing."""
    steps = q.shape[0]
    pad = (-steps) % chunk

    def chunks(x: Array) -> Array:  # (T, H, ...) -> (N, H, C, ...)
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape(-1, chunk, *x.shape[1:])
        return jnp.moveaxis(x, 1, 2)

    q, k, v, beta, g = map(chunks, (q, k, v, beta, g))
    cum = jnp.cumsum(g, axis=-1)  # (N, H, C): the log decay from the chunk's start
    lower = jnp.tril(jnp.ones((1, 1, chunk, chunk), bool))
    gap = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, gap, 0.0)), 0.0)  # exp(G_i - G_j), i >= j
    k_beta = k * beta[..., None]
    system = jnp.einsum("nhcd,nhed->nhce", k_beta, k) * decay
    system = jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(chunk)[None, None]

    inverse = unit_lower_inverse(system)
    u = jnp.einsum("nhce,nhed->nhcd", inverse, v * beta[..., None])
    w = jnp.einsum("nhce,nhed->nhcd", inverse, k_beta * jnp.exp(cum)[..., None])
    inner = jnp.einsum("nhcd,nhed->nhce", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    whole = jnp.exp(cum[..., -1])  # (N, H)

    def across(s: Array, c: tuple[Array, ...]) -> tuple[Array, Array]:
        u_c, w_c, q_c, k_c, inner_c, whole_c = c
        fresh = u_c - jnp.einsum("hcd,hdv->hcv", w_c, s)
        out = jnp.einsum("hcd,hdv->hcv", q_c, s) + jnp.einsum("hce,hev->hcv", inner_c, fresh)
        s = s * whole_c[:, None, None] + jnp.einsum("hcd,hcv->hdv", k_c, fresh)
        return s, out

    memory, out = jax.lax.scan(across, memory, (u, w, q_decayed, k_decayed, inner, whole))
    out = jnp.moveaxis(out, 2, 1)  # (N, C, H, dv)
    out = out.reshape(-1, out.shape[2], out.shape[3])
    return out[:steps], memory


def unit_lower_inverse(t: Array) -> Array:
    """The inverse of unit lower-triangular matrices `t (..., C, C)`, by doubling blocks: with
    `X` the inverse of `t`'s block-diagonal part in blocks of `s` and `E` the part of `t` that
    joins pairs of them into blocks of `2 s` (`(X E)^2 = 0`), the inverse in blocks of `2 s` is
    `X - X E X`: `log2 C` rounds of products over whole matrices and masks (no triangular solve,
    which IREE does not compile, and no block reshapes)."""
    size = t.shape[-1]
    row = jnp.arange(size)[:, None]
    col = jnp.arange(size)[None, :]
    lead = (1,) * (t.ndim - 2)
    inverse = jnp.broadcast_to(jnp.eye(size, dtype=t.dtype).reshape(*lead, size, size), t.shape)
    span = 1
    while span < size:
        joins = (row // (2 * span) == col // (2 * span)) & (row // span != col // span)
        e = jnp.where(joins.reshape(*lead, size, size), t, 0.0)
        inverse = inverse - jnp.einsum("...ab,...bc,...cd->...ad", inverse, e, inverse)
        span *= 2
    return inverse


def _l2normalised(x: Array) -> Array:
    """`x / sqrt(sum(x^2) + 1e-6)` over the last axis (as the FLA kernels and transformers)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan: int) -> Param:
    bound = 1.0 / math.sqrt(fan)
    return Param(jr.uniform(key, shape, minval=-bound, maxval=bound))


class GatedDeltaNet(StatefulMixer):
    """Qwen3.5's Gated DeltaNet layer (`Qwen3_5GatedDeltaNet`): `(T, d_model) -> (T, d_model)`.

    `q, k, v = split(silu(conv(x W_qkv)))` (a causal depthwise convolution of `kernel` steps over
    the `2 n_key_heads key_dim + n_heads value_dim` channels), the queries and keys L2-normalised
    per head (queries then scaled by `key_dim ** -0.5`) and each key head shared by `n_heads /
    n_key_heads` consecutive value heads; `beta = sigmoid(x W_b)`, `g = -exp(A_log) softplus(x W_a
    + dt_bias)` per head; the gated delta rule (see the module); each head's output RMS-normalised
    (`eps`, a gain shared by the heads) times `silu(x W_z)`; then `W_out`.

    **Arguments:** `d_model`, `n_heads` (value heads), `key`, `n_key_heads=None` (default
    `n_heads`), `key_dim=None`, `value_dim=None` (each head's widths; default `d_model /
    n_heads`), `kernel=4`, `eps=1e-6`, `chunk=32` (steps per chunk of the parallel form).
    `params()` is `[W_qkv, W_z, W_b, W_a, conv, A_log, dt_bias, norm_gain, W_out]`.

    Causal; it streams with `init_cache()` (a `DeltaState`), `step` and `prefill`; `mask` (the
    valid steps, a prefix) leaves the state as the valid steps left it.
    """

    W_qkv: Param
    W_z: Param
    W_b: Param
    W_a: Param
    conv: Param
    A_log: Param
    dt_bias: Param
    norm_gain: Param
    W_out: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)
    n_heads: int = eqx.field(static=True, converter=python_scalar)
    n_key_heads: int = eqx.field(static=True, converter=python_scalar)
    key_dim: int = eqx.field(static=True, converter=python_scalar)
    value_dim: int = eqx.field(static=True, converter=python_scalar)
    kernel: int = eqx.field(static=True, converter=python_scalar)
    eps: float = eqx.field(static=True, converter=python_scalar)
    chunk: int = eqx.field(static=True, converter=python_scalar)

    def __init__(
        self, d_model: int, n_heads: int, key: PRNGKeyArray, n_key_heads: int | None = None,
        key_dim: int | None = None, value_dim: int | None = None, kernel: int = 4,
        eps: float = 1e-6, chunk: int = 32,
    ) -> None:  # fmt: skip
        require_key(key)
        require_positive(d_model=d_model, n_heads=n_heads, kernel=kernel, chunk=chunk)
        n_key_heads = n_heads if n_key_heads is None else n_key_heads
        key_dim = d_model // n_heads if key_dim is None else key_dim
        value_dim = d_model // n_heads if value_dim is None else value_dim
        require_positive(n_key_heads=n_key_heads, key_dim=key_dim, value_dim=value_dim)
        require_eps(eps)
        if n_heads % n_key_heads:
            raise ValueError(
                f"GatedDeltaNet: `n_heads={n_heads}` value heads must be a multiple of "
                f"`n_key_heads={n_key_heads}` (each key head serves a group of value heads)."
            )
        keys = jr.split(key, 7)
        channels = 2 * n_key_heads * key_dim + n_heads * value_dim
        self.W_qkv = _uniform(keys[0], (d_model, channels), d_model)
        self.W_z = _uniform(keys[1], (d_model, n_heads * value_dim), d_model)
        self.W_b = _uniform(keys[2], (d_model, n_heads), d_model)
        self.W_a = _uniform(keys[3], (d_model, n_heads), d_model)
        self.conv = _uniform(keys[4], (kernel, channels), kernel)
        self.A_log = Param(jnp.log(jr.uniform(keys[5], (n_heads,), minval=1.0, maxval=16.0)))
        self.dt_bias = Param(jnp.ones((n_heads,)))
        self.norm_gain = Param(jnp.ones((value_dim,)))
        self.W_out = _uniform(keys[6], (n_heads * value_dim, d_model), n_heads * value_dim)
        self.d_model, self.n_heads, self.n_key_heads = d_model, n_heads, n_key_heads
        self.key_dim, self.value_dim, self.kernel = key_dim, value_dim, kernel
        self.eps, self.chunk = float(eps), chunk

    @property
    def channels(self) -> int:
        return 2 * self.n_key_heads * self.key_dim + self.n_heads * self.value_dim

    def init_cache(self, capacity: int | None = None, *, on_overflow: str = "raise") -> DeltaState:
        """The state before the first step (zeros); `capacity` is accepted and not used."""
        validate_overflow_mode(on_overflow)
        if capacity is not None:
            require_positive(capacity=capacity)
        memory = jnp.zeros((self.n_heads, self.key_dim, self.value_dim), jnp.float32)
        return DeltaState(conv_state(self.kernel, self.channels), memory)

    def _heads(self, x: Array, state: DeltaState, mask: Array | None) -> tuple[Any, ...]:
        """The queries, keys, values, rates and log decays of every step, and the
        convolution's state after them."""
        mixed, conv = causal_conv(self.W_qkv.project(x), state.conv, self.conv.value, mask)
        mixed = jax.nn.silu(mixed)
        sizes = (self.n_key_heads * self.key_dim,) * 2
        q, k, v = jnp.split(mixed, [sizes[0], sizes[0] + sizes[1]], axis=-1)
        group = self.n_heads // self.n_key_heads
        q, k = (jnp.repeat(t.reshape(-1, self.n_key_heads, self.key_dim), group, 1) for t in (q, k))
        q = _l2normalised(q) * self.key_dim**-0.5
        k = _l2normalised(k)
        v = v.reshape(-1, self.n_heads, self.value_dim)
        beta = jax.nn.sigmoid(self.W_b.project(x, jnp.float32))
        a = self.W_a.project(x, jnp.float32) + self.dt_bias.value.astype(jnp.float32)[None]
        g = -jnp.exp(self.A_log.value.astype(jnp.float32))[None] * jax.nn.softplus(a)
        if mask is not None:  # a padded step neither decays nor writes the memory
            beta, g = (jnp.where(mask[:, None], t, 0.0) for t in (beta, g))
        return q, k, v, beta, g, conv

    def _run(self, x: Array, state: DeltaState, mask: Array | None) -> tuple[Array, DeltaState]:
        steps = x.shape[0]
        if isinstance(steps, int) and steps == 0:  # no step: no output, the state as it was
            return jnp.zeros_like(x), state
        q, k, v, beta, g, conv = self._heads(x, state, mask)
        if isinstance(steps, int) and steps > 1:
            chunk = min(self.chunk, steps)
            out, memory = delta_rule_chunked(q, k, v, beta, g, state.memory, chunk)
        else:  # one step, or a symbolic length
            out, memory = delta_rule_recurrent(q, k, v, beta, g, state.memory)
        normed = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + self.eps)
        normed = normed * self.norm_gain.value.astype(jnp.float32)[None, None]
        z = self.W_z.project(x, jnp.float32).reshape(-1, self.n_heads, self.value_dim)
        gated = (normed * jax.nn.silu(z)).reshape(steps, -1).astype(x.dtype)
        return self.W_out.project(gated), DeltaState(conv, memory)

    def _check(self, state: object, method: str) -> None:
        owner = f"{type(self).__name__}.{method}"
        if not isinstance(state, DeltaState):
            raise ShapeError(
                f"{owner}: expected the DeltaState of this layer's `init_cache()`; received "
                f"{type(state).__name__}."
            )
        check_conv_state(state.conv, self.kernel, self.channels, owner)
        want = (self.n_heads, self.key_dim, self.value_dim)
        if jnp.shape(state.memory) != want:
            raise ShapeError(
                f"{owner}: received `state.memory.shape={jnp.shape(state.memory)}`; expected "
                f"{want}. Batches of streams go through `jax.vmap`."
            )
