"""The layers of a token language model: `Embedding` (ids to vectors, and back to logits through
the same table), `LMHead` (an untied head), `RMSNorm` and `GatedFeedForward` (SwiGLU, GeGLU).

They follow the checkpoints they load (GPT-2, Llama, Qwen2): weights start normal with std
0.02 (those models' `initializer_range`), statistics are computed in float32, and every layer acts
on each position alone, so it serves a sequence `(T, ...)` and a single step alike.
"""

import contextlib
import contextvars
import numbers
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..core import (
    Param,
    Pointwise,
    python_scalar,
    require_bool,
    require_choice,
    require_key,
    require_positive,
    shape_checked,
)
from ..kernels.choice import is_exporting
from .basic import ACTIVATIONS, check_activation

__all__ = [
    "ID_MODES",
    "Embedding",
    "GatedFeedForward",
    "LMHead",
    "RMSNorm",
    "TokenIdError",
    "ids_checked",
]

INIT_STD = 0.02
# What `Embedding` does with an id outside `[0, vocab)`: refuse it (eagerly a `TokenIdError`,
# under `eqx.filter_jit` Equinox's runtime error), or give NaN rows (for an exported step, whose
# runtime has no error channel: `Embedding.in_range` is the flag to return beside them).
ID_MODES = ("raise", "nan")

_IDS_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("ids_checked", default=False)


@contextlib.contextmanager
def ids_checked() -> Iterator[None]:
    """Within it, a traced `Embedding` with `on_invalid="raise"` gives NaN rows for ids outside
    the vocabulary, as `"nan"` does, instead of Equinox's run-time check: for callers that
    checked their ids before the call, as `generate` does (its prompts are checked, its own
    tokens come from the vocabulary). Such a check is a callback to Python, and JAX keeps no
    function with a callback in its persistent compilation cache: without it, `generate`
    compiles again in every process. Eager calls still raise. The export stage's `exporting()`
    gives NaN rows likewise (an artifact cannot call back)."""
    token = _IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _IDS_CHECKED.reset(token)


class TokenIdError(IndexError, ValueError):
    """A token id outside the vocabulary: both an `IndexError` and a `ValueError`."""


def _normal(key: PRNGKeyArray, shape: tuple[int, ...]) -> Param:
    return Param(INIT_STD * jr.normal(key, shape, jnp.float32))


def require_eps(eps: Any) -> None:
    real = isinstance(eps, numbers.Real) and not isinstance(eps, bool | np.bool_)
    if not real or not np.isfinite(eps) or not eps > 0:
        raise ValueError(
            f"`eps` must be a positive finite number; received `eps={eps!r}` "
            f"({type(eps).__name__})."
        )


class Embedding(Pointwise):
    """A table `table (vocab, d_model)`: integer ids `(*T,)` to their rows `(*T, d_model)`.

    **Arguments:** `vocab`, `d_model`, `key`; `on_invalid="raise"`: an id outside `[0, vocab)` is
    never clamped or wrapped. With `"raise"` it is a `TokenIdError` naming the id and where it
    is (eagerly), or Equinox's runtime error under `eqx.filter_jit` (under plain `jax.jit`, XLA
    wraps that error in a `ValueError` beginning 'INTERNAL: CpuCallback error'). With `"nan"` its
    row is NaN: what an exported step does, returning `in_range(ids)` as its flag. The table
    starts normal with std 0.02. `params()` is `[table]`.

    `attend(h)` is the tied language-model head: `h @ table.T`, logits over the vocabulary
    from the same array (one array, one gradient: the two uses' gradients add up in it), as
    Flax's `nn.Embed.attend`.
    """

    table: Param
    vocab: int = eqx.field(static=True, converter=python_scalar)
    d_model: int = eqx.field(static=True, converter=python_scalar)
    on_invalid: str = eqx.field(static=True, converter=python_scalar, default="raise")

    def __init__(self, vocab: int, d_model: int, key: PRNGKeyArray, *, on_invalid: str = "raise"):
        require_key(key)
        require_positive(vocab=vocab, d_model=d_model)
        require_choice("on_invalid", on_invalid, ID_MODES)
        self.table = _normal(key, (vocab, d_model))
        self.vocab, self.d_model, self.on_invalid = vocab, d_model, on_invalid

    def in_range(self, ids: Int[Array, "*T"]) -> Bool[Array, "*T"]:
        """`True` where an id lies in `[0, vocab)`."""
        return (ids >= 0) & (ids < self.vocab)

    @shape_checked
    def forward(
        self, ids: Int[Array, "*T"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T d_model"]:
        valid = self.in_range(ids)
        rows = self.table.rows(jnp.clip(ids, 0, self.vocab - 1))
        if not isinstance(ids, jax.core.Tracer) and self.on_invalid == "raise":
            bad = np.argwhere(~np.asarray(valid))
            if bad.size:
                where = tuple(int(i) for i in bad[0])
                raise TokenIdError(
                    f"Embedding: token id {int(np.asarray(ids)[where])} at position {where} is "
                    f"outside the vocabulary [0, {self.vocab}) ({len(bad)} such ids in all)."
                )
            return rows
        if self.on_invalid == "nan" or _IDS_CHECKED.get() or is_exporting():
            return jnp.where(valid[..., None], rows, jnp.nan)
        return eqx.error_if(
            rows, ~jnp.all(valid), f"Embedding: a token id is outside [0, {self.vocab})."
        )

    @shape_checked
    def attend(self, h: Float[Array, "*T d_model"]) -> Float[Array, "*T vocab"]:
        """Logits `h @ table.T` over the vocabulary, in float32 whatever the dtype of `h`."""
        return self.table.project_rows(h, jnp.float32)


class LMHead(Pointwise):
    """An untied language-model head: logits `h W`, `W (d_model, vocab)`, no bias (as the heads
    of GPT-2, Llama and Qwen2). A tied head is `Embedding.attend`.

    **Arguments:** `d_model`, `vocab`, `key`. `W` starts normal with std 0.02. `params()` is
    `[W]`.
    """

    W: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)
    vocab: int = eqx.field(static=True, converter=python_scalar)

    def __init__(self, d_model: int, vocab: int, key: PRNGKeyArray):
        require_key(key)
        require_positive(d_model=d_model, vocab=vocab)
        self.W = _normal(key, (d_model, vocab))
        self.d_model, self.vocab = d_model, vocab

    @shape_checked
    def forward(
        self, h: Float[Array, "*T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T vocab"]:
        return self.W.project(h, jnp.float32)


class RMSNorm(Pointwise):
    """Root-mean-square normalisation (Zhang and Sennrich 2019): `x / sqrt(mean(x^2) + eps) *
    gain` over the last axis, as Llama's and Qwen2's `RMSNorm`.

    **Arguments:** `d_model`, `eps=1e-6`, `plus_one=False` (Gemma's: the scale is `1 + gain`,
    `gain` starting at 0). The statistics are computed in float32 whatever the input dtype; the
    output has the input's dtype. `gain` starts at 1; `params()` is `[gain]`.
    """

    gain: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)
    eps: float = eqx.field(static=True, converter=python_scalar)
    plus_one: bool = eqx.field(static=True, converter=python_scalar, default=False)

    def __init__(self, d_model: int, eps: float = 1e-6, *, plus_one: bool = False):
        require_positive(d_model=d_model)
        require_eps(eps)
        require_bool(plus_one=plus_one)
        self.gain = Param(jnp.zeros((d_model,)) if plus_one else jnp.ones((d_model,)))
        self.d_model, self.eps, self.plus_one = d_model, eps, plus_one

    @shape_checked
    def forward(
        self, x: Float[Array, "*T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T d_model"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        gain = self.gain.value.astype(jnp.float32)
        gain = 1.0 + gain if self.plus_one else gain
        return (y * jnp.broadcast_to(gain, y.shape)).astype(x.dtype)


class GatedFeedForward(Pointwise):
    """The gated feed-forward (Shazeer 2020): `(act(x W_gate) * (x W_up)) W_down`, no biases.

    **Arguments:** `d_model`, `d_ff`, `key`, `activation="silu"`: SwiGLU (Llama's and Qwen2's
    MLP); `"gelu_tanh"` or `"gelu"`: GeGLU; any name of `ACTIVATIONS`. The matrices start normal
    with std 0.02. `params()` is `[W_gate, W_up, W_down]`.
    """

    W_gate: Param
    W_up: Param
    W_down: Param
    d_model: int = eqx.field(static=True, converter=python_scalar)
    activation: str = eqx.field(static=True, converter=python_scalar, default="silu")
    # tensor parallelism splits the hidden units: W_gate and W_up by columns, W_down by rows
    tensor_parallel: ClassVar[Mapping[str, tuple[int, str | None]]] = {
        "W_gate": (-1, None),
        "W_up": (-1, None),
        "W_down": (-2, None),
    }

    def __init__(self, d_model: int, d_ff: int, key: PRNGKeyArray, activation: str = "silu"):
        require_key(key)
        require_positive(d_model=d_model, d_ff=d_ff)
        check_activation(activation)
        gkey, ukey, dkey = jr.split(key, 3)
        self.W_gate = _normal(gkey, (d_model, d_ff))
        self.W_up = _normal(ukey, (d_model, d_ff))
        self.W_down = _normal(dkey, (d_ff, d_model))
        self.d_model, self.activation = d_model, activation

    @shape_checked
    def forward(
        self, x: Float[Array, "*T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T d_model"]:
        gate = ACTIVATIONS[self.activation](self.W_gate.project(x))
        return self.W_down.project(gate * self.W_up.project(x))
