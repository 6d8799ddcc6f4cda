"""Stepping a layer through a sequence, and a model's forward on every prefix, for the tests
that compare `step` with `forward`.

The comparisons of streaming paths (tests/test_prefill.py, test_scan.py, test_recurrent.py,
test_rotary.py, test_gqa.py, and the jitted step-against-forward comparisons of test_streaming.py,
test_attention.py, test_models.py and test_sequences.py) build their fixed caches with
`on_overflow="nan"`: they never fill them, and a cache that raises compiles a callback to Python,
which JAX's persistent compilation cache never keeps, so each of those functions compiled again
in every run. The default mode, and what raising does, are tested in tests/test_streaming.py and
tests/test_bad_inputs.py."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def stream(layer, xs, cache, step=None):
    """`(ys, cache)`: `step` (default `layer.step` under `eqx.filter_jit`) applied to each row of
    `xs` in turn. Jitted, a step compiles once per cache shape; run eagerly, each of its dozens of
    operations compiled at every new shape (a growing cache's every length): measured on the
    longest of them (test_prefill's growing encoder), 18-21 s eagerly against 10 s jitted with
    empty compilation caches, 7.0 s against 6.4 s with warm ones."""
    step = step or eqx.filter_jit(layer.step)
    ys = []
    for x_t in xs:
        y_t, cache = step(x_t, cache)
        ys.append(y_t)
    return jnp.stack(ys), cache


def prefix_outputs(model, xs, direct=(0, -1), atol=2e-5):
    """`model` on every prefix `xs[: t + 1]`, stacked: computed as the whole sequence with the
    steps after `t` masked out, one compilation for all prefixes (a padded sequence gives its
    unpadded output: tests/test_sequences.py). The prefixes at `direct` are also run unpadded
    and must agree."""
    steps = xs.shape[0]
    masks = jnp.arange(steps)[None, :] <= jnp.arange(steps)[:, None]
    outputs = jax.jit(jax.vmap(lambda m, mask: m(xs, mask=mask), in_axes=(None, 0)))(model, masks)
    for t in direct:
        t = t % steps
        np.testing.assert_allclose(outputs[t], model(xs[: t + 1]), atol=atol)
    return outputs
