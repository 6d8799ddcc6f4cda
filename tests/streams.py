"""Stepping a layer through a sequence, for the tests that compare `step` with `forward`."""

import jax.numpy as jnp


def stream(layer, xs, cache, step=None):
    """`(ys, cache)`: `step` (default `layer.step`) applied to each row of `xs` in turn."""
    step = step or layer.step
    ys = []
    for x_t in xs:
        y_t, cache = step(x_t, cache)
        ys.append(y_t)
    return jnp.stack(ys), cache
