"""Recurrent layers against their peers: forward + backward (the gradient of a loss on every
step's output, with respect to the weights) at T = 4096, batch 8, d 256, jitted, interleaved.

dense_armor's GRU, LSTM and minGRU, its causal blocked attention (8 heads), Equinox's `GRUCell`
under `jax.lax.scan` and Flax NNX's `nnx.RNN(nnx.GRUCell)`. Goals: minGRU at least 5x faster
than the sequential GRU; dense_armor's GRU no slower than the faster peer.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

from dense_armor.utility.neural import GRU, LSTM, MinGRU, MultiHeadSelfAttention

from .harness import interleaved, table

T, B, D = 4096, 8, 256


def _loss_of(apply):
    """A jitted `(params) -> grads` of the mean square of every step's output over the batch."""

    def loss(params, static, xs):
        return jnp.mean(jnp.square(apply(eqx.combine(params, static), xs)))

    return jax.jit(jax.grad(loss), static_argnums=1)


def _dense_armor(layer, xs):
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    grad = _loss_of(lambda m, xs: jax.vmap(m)(xs))
    return lambda: grad(params, static, xs)


def _equinox_gru(key, xs):
    cell = eqx.nn.GRUCell(D, D, key=key)

    def apply(cell, xs):
        def one(x):
            return jax.lax.scan(lambda h, x_t: (cell(x_t, h),) * 2, jnp.zeros(D), x)[1]

        return jax.vmap(one)(xs)

    params, static = eqx.partition(cell, eqx.is_inexact_array)
    grad = _loss_of(apply)
    return lambda: grad(params, static, xs)


def _flax_gru(xs):
    rnn = nnx.RNN(nnx.GRUCell(D, D, rngs=nnx.Rngs(0)))
    graph, params, rest = nnx.split(rnn, nnx.Param, ...)

    @jax.jit
    def grad(params, xs):
        def loss(params):
            model = nnx.merge(graph, params, rest)
            return jnp.mean(jnp.square(model(xs, initial_carry=jnp.zeros((B, D)))))

        return jax.grad(loss)(params)

    return lambda: grad(params, xs)


def run() -> str:
    key = jax.random.PRNGKey(0)
    xs = jax.random.normal(key, (B, T, D))
    systems = {
        "dense_armor GRU": _dense_armor(GRU(D, D, key), xs),
        "dense_armor LSTM": _dense_armor(LSTM(D, D, key), xs),
        "dense_armor MinGRU": _dense_armor(MinGRU(D, D, key), xs),
        "Equinox GRUCell + lax.scan": _equinox_gru(key, xs),
        "Flax NNX nnx.RNN(GRUCell)": _flax_gru(xs),
    }
    attention = MultiHeadSelfAttention(D, 8, key, causal=True, implementation="blocked")
    systems["dense_armor blocked attention"] = _dense_armor(attention, xs)
    medians = interleaved(systems, rounds=5, warmup=1)
    gru = medians["dense_armor GRU"]
    peer = min(medians["Equinox GRUCell + lax.scan"], medians["Flax NNX nnx.RNN(GRUCell)"])
    return "\n".join(
        [
            table(
                f"recurrent layers, forward + backward, T {T}, batch {B}, d {D}",
                medians,
                "dense_armor GRU",
                "ms",
            ),
            f"  minGRU is {gru / medians['dense_armor MinGRU']:.1f}x faster than the GRU "
            f"(goal: at least 5x); the GRU takes {gru / peer:.2f}x the faster peer's time "
            "(goal: at most 1x)",
        ]
    )
