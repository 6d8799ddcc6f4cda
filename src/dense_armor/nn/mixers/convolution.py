"""Short causal convolutions on the streaming protocol: the depthwise convolution that LFM2's
convolution layers and Qwen3.5's Gated DeltaNet layers run over their inputs, and `ShortConv`,
LFM2's gated convolution mixer.

A causal depthwise convolution of kernel `k` reads, at step `t`, its channels' inputs at steps
`t - k + 1 ... t`: its state is the last `k - 1` inputs (`ConvState`, zeros before the first
step), so a stream costs `(k - 1) x channels` numbers however long it runs. `forward`, `prefill`
and `step` compute the same thing: the inputs after the state, `k` shifted products summed (no
loop over time).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..core import (
    Param,
    ShapeError,
    python_scalar,
    require_bool,
    require_key,
    require_positive,
)
from ..state.counter import validate_overflow_mode
from .stateful import StatefulMixer

__all__ = ["ConvState", "ShortConv", "causal_conv"]


class ConvState(eqx.Module):
    """A causal convolution's state: its last `k - 1` inputs `(k - 1, channels)`, oldest
    first."""

    inputs: Float[Array, "k_1 channels"]


def causal_conv(
    u: Array, state: ConvState, kernel: Array, mask: Array | None = None
) -> tuple[Array, ConvState]:
    """The depthwise causal convolution of `u (K, channels)` after `state`: `y_t = sum_j
    kernel[j] * u_{t - k + 1 + j}` (`kernel (k, channels)`, torch's `conv1d` weight `(channels,
    1, k)` transposed), in float32, and the state after the last valid step (`mask`: the valid
    steps, a prefix; default all)."""
    k = kernel.shape[0]
    full = jnp.concatenate([state.inputs.astype(jnp.float32), u.astype(jnp.float32)])
    w = kernel.astype(jnp.float32)
    n = u.shape[0]
    y = w[0][None] * full[:n]
    for j in range(1, k):
        y = y + w[j][None] * full[j : j + n]
    if k == 1:
        return y, state
    if mask is None:
        return y, ConvState(full[n:])
    valid = jnp.sum(mask.astype(jnp.int32))  # the last k - 1 inputs of the valid prefix
    kept = jax.lax.dynamic_slice_in_dim(full, valid, k - 1)
    return y, ConvState(kept)


def conv_state(kernel: int, channels: int) -> ConvState:
    """The state before the first step: `kernel - 1` rows of zeros."""
    return ConvState(jnp.zeros((kernel - 1, channels), jnp.float32))


def check_conv_state(state: object, kernel: int, channels: int, owner: str) -> None:
    if not isinstance(state, ConvState) or jnp.shape(state.inputs) != (kernel - 1, channels):
        shape = jnp.shape(state.inputs) if isinstance(state, ConvState) else type(state).__name__
        raise ShapeError(
            f"{owner}: expected the ConvState of this layer's `init_cache()`, inputs of shape "
            f"{(kernel - 1, channels)}; received {shape}. Batches of streams go through "
            "`jax.vmap`."
        )


def _linear(key: PRNGKeyArray, n_in: int, n_out: int) -> Param:
    bound = 1.0 / math.sqrt(n_in)
    return Param(jr.uniform(key, (n_in, n_out), minval=-bound, maxval=bound))


class ShortConv(StatefulMixer):
    """LFM2's gated short convolution (Liquid AI 2025, `Lfm2ShortConv`): `B, C, x = split(x W_in,
    3)`, `y = C * conv(B * x)`, then `y W_out`, `conv` a causal depthwise convolution of
    `kernel` steps over the `d_model` channels.

    **Arguments:** `d_model`, `key`, `kernel=3` (LFM2's `conv_L_cache`), `use_bias=False` (biases
    on the projections and the convolution: LFM2's `conv_bias`). `params()` is `[W_in, conv,
    W_out]` (then `b_in`, `b_conv`, `b_out` with biases): `W_in (d_model, 3 d_model)` its
    columns `B, C, x` in that order, `conv (kernel, d_model)` (torch's `(d_model, 1, kernel)`
    transposed), `W_out (d_model, d_model)`.

    Causal; it streams with `init_cache()` (a `ConvState` of `kernel - 1` rows), `step` and
    `prefill`. The products run in the input's dtype, the convolution in float32.
    """

    W_in: Param
    conv: Param
    W_out: Param
    b_in: Param | None
    b_conv: Param | None
    b_out: Param | None
    d_model: int = eqx.field(static=True, converter=python_scalar)
    kernel: int = eqx.field(static=True, converter=python_scalar)

    def __init__(self, d_model: int, key: PRNGKeyArray, kernel: int = 3, use_bias: bool = False):
        require_key(key)
        require_positive(d_model=d_model, kernel=kernel)
        require_bool(use_bias=use_bias)
        ikey, ckey, okey = jr.split(key, 3)
        self.W_in = _linear(ikey, d_model, 3 * d_model)
        bound = 1.0 / math.sqrt(kernel)
        self.conv = Param(jr.uniform(ckey, (kernel, d_model), minval=-bound, maxval=bound))
        self.W_out = _linear(okey, d_model, d_model)
        zeros = lambda n: Param(jnp.zeros((n,))) if use_bias else None  # noqa: E731
        self.b_in, self.b_conv, self.b_out = zeros(3 * d_model), zeros(d_model), zeros(d_model)
        self.d_model, self.kernel = d_model, kernel

    def init_cache(self, capacity: int | None = None, *, on_overflow: str = "raise") -> ConvState:
        """The state before the first step (zeros); `capacity` is accepted and not used."""
        validate_overflow_mode(on_overflow)
        if capacity is not None:
            require_positive(capacity=capacity)
        return conv_state(self.kernel, self.d_model)

    def _check(self, state: object, method: str) -> None:
        check_conv_state(state, self.kernel, self.d_model, f"{type(self).__name__}.{method}")

    def _run(self, x: Array, state: ConvState, mask: Array | None) -> tuple[Array, ConvState]:
        h = self.W_in.project(x)
        if self.b_in is not None:
            h = h + self.b_in.value.astype(h.dtype)[None]
        b, c, v = jnp.split(h, 3, axis=-1)
        y, state = causal_conv(b * v, state, self.conv.value, mask)
        if self.b_conv is not None:
            y = y + self.b_conv.value.astype(y.dtype)[None]
        out = self.W_out.project((c.astype(jnp.float32) * y).astype(x.dtype))
        if self.b_out is not None:
            out = out + self.b_out.value.astype(out.dtype)[None]
        return out, state
