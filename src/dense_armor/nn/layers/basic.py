"""Dense, LayerNorm, Dropout, ReLU, FeedForward and MeanOverTime.

All but `MeanOverTime` act on each time step alone: they accept `(..., features)` and keep the
leading axes, so they serve both a sequence `(T, features)` and a single step `(features,)`.
"""

import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import (
    CannotStream,
    Layer,
    Param,
    Pointwise,
    ShapeError,
    python_scalar,
    require_choice,
    require_key,
    require_positive,
    require_rate,
    shape_checked,
)
from ..state.cache import MeanCache

__all__ = [
    "ACTIVATIONS",
    "COMPUTE_DTYPES",
    "Cast",
    "Dense",
    "Dropout",
    "FeedForward",
    "LayerNorm",
    "MeanOverTime",
    "ReLU",
]

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


class Dense(Pointwise):
    """An affine map `y = x W + b`, with `W` of shape `(n_in, n_out)` and `b` of shape `(n_out,)`.

    **Arguments:** `n_in`, `n_out` (the widths), `key`. `W` and `b` start uniform in
    `[-1/sqrt(n_in), 1/sqrt(n_in)]`, as in Equinox and PyTorch.

    `params()` is `[W, b]`.
    """

    W: Param
    b: Param
    n_in: int = eqx.field(static=True, converter=python_scalar)
    n_out: int = eqx.field(static=True, converter=python_scalar)

    def __init__(self, n_in: int, n_out: int, key: PRNGKeyArray):
        require_key(key)
        require_positive(n_in=n_in, n_out=n_out)
        wkey, bkey = jr.split(key)
        bound = 1.0 / n_in**0.5
        self.W = Param(jr.uniform(wkey, (n_in, n_out), minval=-bound, maxval=bound))
        self.b = Param(jr.uniform(bkey, (n_out,), minval=-bound, maxval=bound))
        self.n_in = n_in
        self.n_out = n_out

    @shape_checked
    def forward(
        self, x: Float[Array, "*T n_in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T n_out"]:
        y = self.W.project(x)
        return y + jnp.broadcast_to(self.b.value.astype(x.dtype), y.shape)


class Cast(Pointwise):
    """Cast the input to a compute dtype (`"float32"`, `"bfloat16"` or `"float16"`).

    The mixed-precision policy of dense_armor: parameters stay float32 and every layer computes in
    the dtype of its input, with the softmax, LayerNorm statistics and time means in float32. So a
    `Cast("bfloat16")` in front of a model (`transformer_encoder(..., compute_dtype="bfloat16")`)
    runs it in bfloat16, and its outputs come out in bfloat16. No parameters.
    """

    dtype: str = eqx.field(static=True, converter=python_scalar)

    def __init__(self, dtype: str):
        require_choice("dtype", dtype, COMPUTE_DTYPES)
        self.dtype = dtype

    @shape_checked
    def forward(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        return x.astype(self.dtype)


@jax.custom_jvp
def relu(x: Array) -> Array:
    """`max(0, x)` as `jax.nn.relu` computes it (NaN stays NaN; its derivative, `jax.nn.relu`'s
    own, is 1 where `x > 0` and 0 elsewhere, at 0 and NaN included), written as a select: XLA's
    CPU compiler fuses a feed-forward's products and activation into one library call, to which
    `jax.nn.relu`'s maximum against zero passes a whole materialised array of zeros (8 MiB per
    block at B=32, T=128, d_ff=512)."""
    return jnp.where(x <= 0, jnp.zeros((), x.dtype), x)


relu.defjvps(lambda g, _, x: jnp.where(x > 0, g, jnp.zeros((), g.dtype)))


class ReLU(Pointwise):
    """`max(0, x)`, elementwise. No parameters."""

    @shape_checked
    def forward(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        return relu(x)


class LayerNorm(Pointwise):
    """Normalise the last axis to mean 0 and variance 1, then scale by `gain` and shift by `bias`.

    The statistics are computed in float32 whatever the input dtype; the output has the input's
    dtype. `gain` starts at 1 and `bias` at 0; `params()` is `[gain, bias]`.
    """

    gain: Param
    bias: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)
    eps: float = eqx.field(static=True, converter=python_scalar)

    def __init__(self, d_model: int, eps: float = 1e-5):
        require_positive(d_model=d_model)
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
            raise ValueError(
                f"`eps` must be a positive number; received `eps={eps!r}` ({type(eps).__name__})."
            )
        self.gain = Param(jnp.ones((d_model,)))
        self.bias = Param(jnp.zeros((d_model,)))
        self.d_model = d_model
        self.eps = eps

    @shape_checked
    def forward(
        self, x: Float[Array, "*T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T d_model"]:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
        # Equinox's and Flax's formula: a reciprocal square root, then a product.
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        # in float32 whatever the weights' dtype (a bfloat16 gain widened exactly)
        gain = jnp.broadcast_to(self.gain.value.astype(jnp.float32), y.shape)
        bias = jnp.broadcast_to(self.bias.value.astype(jnp.float32), y.shape)
        return (y * gain + bias).astype(x.dtype)


class Dropout(Pointwise):
    """Zero each element with probability `rate` and scale the rest by `1 / (1 - rate)`.

    Active only when a `key` is passed and `rate > 0`; without a key it is the identity, so
    inference is the default and is deterministic.
    """

    rate: float = eqx.field(static=True, converter=python_scalar)

    def __init__(self, rate: float = 0.0):
        require_rate(rate=rate)
        self.rate = rate

    @shape_checked
    def forward(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        if key is None or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        keep = jr.bernoulli(key, 1.0 - self.rate, x.shape)
        return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros_like(x))


def gelu(x: Array) -> Array:
    """The exact, erf-based GELU (PyTorch's `F.gelu`)."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: Array) -> Array:
    """GELU's tanh approximation, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`: GPT-2's
    `gelu_new`, PyTorch's `F.gelu(approximate="tanh")`."""
    return jax.nn.gelu(x, approximate=True)


# The feed-forward activations by name, for `FeedForward` and `GatedFeedForward`: `"silu"` is
# `x sigmoid(x)` (Llama's and Qwen2's, in their gated feed-forward).
ACTIVATIONS: Mapping[str, Callable[[Array], Array]] = {
    "relu": relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": jax.nn.silu,
}


def check_activation(activation: Any) -> None:
    """Refuse an activation name that `ACTIVATIONS` does not hold."""
    require_choice("activation", activation, tuple(ACTIVATIONS))


class FeedForward(Pointwise):
    """`FFN(x) = max(0, x W_1 + b_1) W_2 + b_2` (Vaswani et al. 2017, Eq.(2), page 5).

    `activation="relu"` (the page's); `"gelu"` is the exact, erf-based GELU (PyTorch's default
    `F.gelu`, and its `nn.TransformerEncoderLayer(activation="gelu")`); `"gelu_tanh"` its tanh
    approximation (GPT-2's); `"silu"` is `x sigmoid(x)` (see `ACTIVATIONS`).
    `params()` is `[W_1, b_1, W_2, b_2]` (the two `Dense` layers `hidden` and `out`).
    """

    hidden: Dense
    out: Dense
    d_model: int = eqx.field(static=True, converter=python_scalar)
    activation: str = eqx.field(static=True, converter=python_scalar, default="relu")
    # tensor parallelism splits the hidden units: W_1 and b_1 by columns, W_2 by rows
    tensor_parallel: ClassVar[Mapping[str, tuple[int, str | None]]] = {
        "hidden.W": (-1, None),
        "hidden.b": (-1, None),
        "out.W": (-2, None),
    }

    def __init__(self, d_model: int, d_ff: int, key: PRNGKeyArray, activation: str = "relu"):
        require_key(key)
        require_positive(d_model=d_model, d_ff=d_ff)
        check_activation(activation)
        hkey, okey = jr.split(key)
        self.hidden = Dense(d_model, d_ff, hkey)
        self.out = Dense(d_ff, d_model, okey)
        self.d_model = d_model
        self.activation = activation

    @shape_checked
    def forward(
        self, x: Float[Array, "*T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T d_model"]:
        h = self.hidden(x)
        return self.out(ACTIVATIONS[self.activation](h))


class MeanOverTime(Layer):
    """The mean over the time axis: `(T, features) -> (features,)`, accumulated in float32.

    **Arguments:** `features`, the width, needed only to stream (`init_cache` preallocates the
    running sum); `transformer_encoder` sets it. Stepping keeps a running sum and count, so the
    output after `t` steps is the mean of those `t` samples. No parameters.

    `forward(x, mask=None)`: with the padding mask of `Layer`, the mean over the valid steps only;
    a sequence with no valid step gives zeros.
    """

    features: int | None = eqx.field(static=True, converter=python_scalar, default=None)
    accepts_mask: ClassVar[bool] = True

    def __init__(self, features: int | None = None):
        if features is not None:
            require_positive(features=features)
        self.features = features

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T features"],
        *,
        mask: Bool[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " features"]:
        if x.shape[0] == 0:
            raise ShapeError("MeanOverTime.forward: received an empty sequence (T=0).")
        x32 = x.astype(jnp.float32)
        if mask is None:
            return x32.mean(axis=0).astype(x.dtype)
        total = jnp.where(mask[:, None], x32, 0.0).sum(axis=0)
        count = jnp.maximum(mask.sum(), 1).astype(jnp.float32)
        return (total / count).astype(x.dtype)

    def init_cache(self, capacity: int | None = None, *, on_overflow: str = "raise") -> MeanCache:
        if self.features is None:
            raise CannotStream(
                "MeanOverTime needs its width to stream: build it as `MeanOverTime(features)`."
            )
        return MeanCache(jnp.zeros((self.features,)), jnp.zeros((), jnp.int32))

    @shape_checked
    def prefill(
        self, x: Float[Array, "K features"], cache: MeanCache
    ) -> tuple[Float[Array, "K features"], MeanCache]:
        """The running mean after each of `K` more steps (none for an empty chunk)."""
        if x.shape[0] == 0:
            return x, cache
        totals = cache.total[None, :] + jnp.cumsum(x.astype(cache.total.dtype), axis=0)
        counts = cache.count + jnp.arange(1, x.shape[0] + 1, dtype=cache.count.dtype)
        means = totals / counts.astype(totals.dtype)[:, None]
        return means.astype(x.dtype), MeanCache(totals[-1], counts[-1])
