"""Recurrent layers: `GRU`, `LSTM` and `MinGRU`, on the streaming protocol of the attention layers.

A recurrent layer carries a state from step to step; that state is its cache. `init_cache()`
returns the state before the first step (zeros), `step(x_t, state) -> (h_t, state)` advances it
by one step and `prefill(x_chunk, state)` by many, so a recurrent layer sits in a causal model
beside attention layers and streams, prefills, resets (`reset`: a stream's state back to zeros)
and exports the same way. Its cache has one size whatever the number of steps seen: `d_hidden`
numbers (two vectors for the LSTM), where an attention layer's cache grows by a key and a value per
step.

Mixed precision as everywhere in dense_armor: the input projections run in the dtype of the
input (e.g. bfloat16); the gates and the state are float32, and the outputs come back in the
input's dtype.

Padding: `forward(x, mask=mask)` and `prefill(x, state, mask=mask)` skip the steps where `mask`
is false: their state is left unchanged (and their output row is the unchanged state), so a
padded sequence ends in the state of its valid steps.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import (
    Layer,
    Param,
    ShapeError,
    python_scalar,
    require_key,
    require_positive,
    shape_checked,
)
from ..state.counter import validate_overflow_mode

__all__ = ["GRU", "LSTM", "RECURRENT", "HiddenState", "LSTMState", "MinGRU", "Recurrent"]


class HiddenState(eqx.Module):
    """The state of a GRU or a minGRU after the steps seen so far: its hidden vector `h`."""

    h: Float[Array, " d_hidden"]


class LSTMState(eqx.Module):
    """The state of an LSTM after the steps seen so far: its hidden vector `h` and cell `c`."""

    h: Float[Array, " d_hidden"]
    c: Float[Array, " d_hidden"]


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan: int) -> Param:
    bound = 1.0 / math.sqrt(fan)
    return Param(jr.uniform(key, shape, minval=-bound, maxval=bound))


def _gated_weights(
    n_in: int, d_hidden: int, gates: int, key: PRNGKeyArray
) -> tuple[Param, Param, Param, Param]:
    """`W_i (n_in, gates d_hidden)`, `W_h (d_hidden, gates d_hidden)`, `b_i`, `b_h`, uniform in
    `[-1/sqrt(d_hidden), 1/sqrt(d_hidden)]`, as PyTorch and Equinox start a GRU or an LSTM."""
    require_key(key)
    require_positive(n_in=n_in, d_hidden=d_hidden)
    ikey, hkey, bikey, bhkey = jr.split(key, 4)
    width = gates * d_hidden
    return (
        _uniform(ikey, (n_in, width), d_hidden),
        _uniform(hkey, (d_hidden, width), d_hidden),
        _uniform(bikey, (width,), d_hidden),
        _uniform(bhkey, (width,), d_hidden),
    )


def _affine(x: Array, weight: Param, bias: Param) -> Array:
    """`x W + b` in the dtype of `x`."""
    y = weight.project(x)
    return y + jnp.broadcast_to(bias.value.astype(x.dtype), y.shape)


class Recurrent(Layer):
    """Base class of the recurrent layers: `(T, n_in) -> (T, d_hidden)`, every step's output.

    A subclass gives what each step reads of its input (`_inputs`, computed for all steps at
    once) and the cell (`_cell`, one step of the recurrence on it); `forward`, `prefill` and
    `step` are written once, here, over `jax.lax.scan`. The GRU and the LSTM project each step's
    input inside the scan, beside the recurrent product: measured on a CPU at T = 4096, that is
    about a fifth faster than one product for the whole sequence up front, whose `(T, 3 d_hidden)`
    result the scan then reads and its backward pass writes.
    """

    n_in: int = eqx.field(static=True, converter=python_scalar)
    d_hidden: int = eqx.field(static=True, converter=python_scalar)
    causal: ClassVar[bool] = True  # a recurrence only ever looks back
    accepts_mask: ClassVar[bool] = True
    state_type: ClassVar[type] = HiddenState

    def _inputs(self, x: Array) -> Array:
        return x

    def _cell(self, u: Array, state: Any, dtype: Any) -> Any:
        raise NotImplementedError

    def init_cache(
        self, capacity: int | None = None, *, on_overflow: str = "raise"
    ) -> HiddenState | LSTMState:
        """The state before the first step: zeros. A state has one size however many steps it
        has seen, so `capacity` is accepted (the models pass it to every layer) and not used,
        and a recurrent layer never overflows."""
        validate_overflow_mode(on_overflow)
        if capacity is not None:
            require_positive(capacity=capacity)
        zeros = [jnp.zeros((self.d_hidden,)) for _ in dataclasses.fields(self.state_type)]
        return self.state_type(*zeros)

    def _check_state(self, state: Any, method: str) -> None:
        owner = f"{type(self).__name__}.{method}"
        if not isinstance(state, self.state_type):
            raise ShapeError(
                f"{owner}: expected the {self.state_type.__name__} of this layer's `init_cache()`; "
                f"received {type(state).__name__}."
            )
        for name, value in vars(state).items():
            if jnp.shape(value) != (self.d_hidden,):
                raise ShapeError(
                    f"{owner}: received `state.{name}.shape={jnp.shape(value)}`; expected "
                    f"`(d_hidden={self.d_hidden},)`. Batches of streams go through `jax.vmap`."
                )

    def _run(self, x: Array, state: Any, mask: Array | None) -> tuple[Array, Any]:
        """Every step's output (in the input's dtype) and the final state, one step at a
        time."""
        u = self._inputs(x)

        def tick(state: Any, inputs: tuple[Array, Array | None]) -> tuple[Any, Array]:
            u_t, keep = inputs
            new = self._cell(u_t, state, x.dtype)
            if keep is not None:  # a padded step keeps the state (no select without a mask)
                new = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, state)
            return new, new.h

        state, h = jax.lax.scan(tick, state, (u, mask))
        return h.astype(x.dtype), state

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T n_in"],
        *,
        mask: Bool[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_hidden"]:
        """Every step's output `h_t`, from the zero state; a step where `mask` is false leaves
        the state unchanged."""
        return self._run(x, self.init_cache(), mask)[0]

    @shape_checked
    def prefill(
        self,
        x: Float[Array, "K n_in"],
        cache: HiddenState | LSTMState,
        *,
        mask: Bool[Array, " K"] | None = None,
    ) -> tuple[Float[Array, "K d_hidden"], HiddenState | LSTMState]:
        """`K` steps from the state `cache`: what `K` calls of `step` return, stacked. A step
        where `mask` is false leaves the state unchanged."""
        self._check_state(cache, "prefill")
        return self._run(x, cache, mask)


class GRU(Recurrent):
    """The gated recurrent unit (Cho et al. 2014), in PyTorch's `nn.GRU` form:

    `r = sigmoid(x W_ir + b_ir + h W_hr + b_hr)`, `z = sigmoid(x W_iz + b_iz + h W_hz + b_hz)`,
    `n = tanh(x W_in + b_in + r * (h W_hn + b_hn))`, `h' = (1 - z) * n + z * h`.

    **Arguments:** `n_in`, `d_hidden`, `key`. `params()` is `[W_i, W_h, b_i, b_h]`: `W_i (n_in, 3
    d_hidden)` and `W_h (d_hidden, 3 d_hidden)`, their columns the gates `r, z, n` in that order,
    and the biases `(3 d_hidden,)`; PyTorch's `weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`,
    `bias_hh_l0`, the matrices transposed. All start uniform in `[-1/sqrt(d_hidden),
    1/sqrt(d_hidden)]`, as in PyTorch and Equinox.

    `forward(x, mask=None)` maps `(T, n_in) -> (T, d_hidden)`, every step's `h`; it streams with
    `init_cache()`, `step` and `prefill` (see `Recurrent`).
    """

    W_i: Param
    W_h: Param
    b_i: Param
    b_h: Param

    def __init__(self, n_in: int, d_hidden: int, key: PRNGKeyArray):
        self.W_i, self.W_h, self.b_i, self.b_h = _gated_weights(n_in, d_hidden, 3, key)
        self.n_in = n_in
        self.d_hidden = d_hidden

    def _cell(self, x_t: Array, state: HiddenState, dtype: Any) -> HiddenState:
        h = state.h
        u = _affine(x_t, self.W_i, self.b_i).astype(jnp.float32)
        v = _affine(h.astype(dtype), self.W_h, self.b_h).astype(jnp.float32)
        u_r, u_z, u_n = jnp.split(u, 3)
        v_r, v_z, v_n = jnp.split(v, 3)
        r = jax.nn.sigmoid(u_r + v_r)
        z = jax.nn.sigmoid(u_z + v_z)
        n = jnp.tanh(u_n + r * v_n)
        return HiddenState(n + z * (h - n))


class LSTM(Recurrent):
    """Long short-term memory (Hochreiter and Schmidhuber 1997, with the forget gate of Gers et
    al. 2000), in PyTorch's `nn.LSTM` form:

    `i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of x W_i + b_i + h W_h + b_h` (split in four),
    `c' = f * c + i * g`, `h' = o * tanh(c')`.

    **Arguments:** `n_in`, `d_hidden`, `key`. `params()` is `[W_i, W_h, b_i, b_h]`: `W_i (n_in, 4
    d_hidden)`, `W_h (d_hidden, 4 d_hidden)`, columns the gates `i, f, g, o` in that order, and
    the biases `(4 d_hidden,)`; PyTorch's `nn.LSTM` weights transposed. All start uniform in
    `[-1/sqrt(d_hidden), 1/sqrt(d_hidden)]`. The state is an `LSTMState(h, c)`; the output is
    every step's `h`.
    """

    W_i: Param
    W_h: Param
    b_i: Param
    b_h: Param
    state_type: ClassVar[type] = LSTMState

    def __init__(self, n_in: int, d_hidden: int, key: PRNGKeyArray):
        self.W_i, self.W_h, self.b_i, self.b_h = _gated_weights(n_in, d_hidden, 4, key)
        self.n_in = n_in
        self.d_hidden = d_hidden

    def _cell(self, x_t: Array, state: LSTMState, dtype: Any) -> LSTMState:
        u = _affine(x_t, self.W_i, self.b_i).astype(jnp.float32)
        gates = u + _affine(state.h.astype(dtype), self.W_h, self.b_h).astype(jnp.float32)
        i, f, g, o = jnp.split(gates, 4)
        c = jax.nn.sigmoid(f) * state.c + jax.nn.sigmoid(i) * jnp.tanh(g)
        return LSTMState(jax.nn.sigmoid(o) * jnp.tanh(c), c)


class MinGRU(Recurrent):
    """minGRU (Feng et al. 2024, "Were RNNs All We Needed?", Section 3.1): a GRU whose gate and
    candidate read only the input, so the recurrence is linear in `h` and trains in parallel.

    `z = sigmoid(x W_z + b_z)`, `h~ = x W_h + b_h`, `h' = (1 - z) * h + z * h~`.

    `forward` and `prefill` compute every step at once with `jax.lax.associative_scan` over the
    affine maps `h -> a h + b` (`a = 1 - z`, `b = z h~`), composed in a tree of depth `log2 T`.
    The form is stable in float32: `a` is computed as `sigmoid(-k)` (never `1 - sigmoid(k)`,
    which cancels), every `a` lies in `(0, 1)`, so the composed maps only shrink and nothing
    overflows. A step is O(1): one affine map. (Under `jax.export` with a symbolic length, the
    sequence is scanned one step at a time: a parallel scan needs a known length.)

    **Arguments:** `n_in`, `d_hidden`, `key`. `params()` is `[W_z, b_z, W_h, b_h]`, `W (n_in,
    d_hidden)` and `b (d_hidden,)`, uniform in `[-1/sqrt(n_in), 1/sqrt(n_in)]` like `Dense`.
    """

    W_z: Param
    b_z: Param
    W_h: Param
    b_h: Param

    def __init__(self, n_in: int, d_hidden: int, key: PRNGKeyArray):
        require_key(key)
        require_positive(n_in=n_in, d_hidden=d_hidden)
        zkey, bzkey, hkey, bhkey = jr.split(key, 4)
        self.W_z = _uniform(zkey, (n_in, d_hidden), n_in)
        self.b_z = _uniform(bzkey, (d_hidden,), n_in)
        self.W_h = _uniform(hkey, (n_in, d_hidden), n_in)
        self.b_h = _uniform(bhkey, (d_hidden,), n_in)
        self.n_in = n_in
        self.d_hidden = d_hidden

    def _inputs(self, x: Array) -> Array:
        """`(a, b)` of every step side by side, `(T, 2 d_hidden)`, in float32."""
        k = _affine(x, self.W_z, self.b_z).astype(jnp.float32)
        candidate = _affine(x, self.W_h, self.b_h).astype(jnp.float32)
        return jnp.concatenate([jax.nn.sigmoid(-k), jax.nn.sigmoid(k) * candidate], axis=-1)

    def _cell(self, u: Array, state: HiddenState, dtype: Any) -> HiddenState:
        a, b = jnp.split(u, 2)
        return HiddenState(a * state.h + b)

    def _run(self, x: Array, state: Any, mask: Array | None) -> tuple[Array, Any]:
        length = x.shape[0]
        if not isinstance(length, int) or length < 2:
            return super()._run(x, state, mask)  # a symbolic length, or nothing to parallelise
        a, b = jnp.split(self._inputs(x), 2, axis=-1)
        if mask is not None:  # a skipped step is the identity map
            a = jnp.where(mask[:, None], a, 1.0)
            b = jnp.where(mask[:, None], b, 0.0)
        b = jnp.concatenate([b[:1] + a[:1] * state.h[None], b[1:]])  # the first map on the state

        def compose(earlier: tuple[Array, Array], later: tuple[Array, Array]) -> tuple[Any, Any]:
            return earlier[0] * later[0], later[0] * earlier[1] + later[1]

        h = jax.lax.associative_scan(compose, (a, b))[1]
        return h.astype(x.dtype), HiddenState(h[-1])


RECURRENT: dict[str, Callable[[int, int, PRNGKeyArray], Recurrent]] = {
    "gru": GRU,
    "lstm": LSTM,
    "mingru": MinGRU,
}
