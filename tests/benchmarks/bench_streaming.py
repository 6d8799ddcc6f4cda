"""Per-step latency of a causal self-attention with a fixed cache, against Flax NNX's decode
cache and against recomputing a causal forward over the whole prefix.

MultiHeadSelfAttention(d_model=128, n_heads=8, causal=True), capacity 512, batch 1, jitted,
float32. The cache is half full when timed. Also: the whole encoder's step (depth 2).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from dense_armor.utility.neural import MultiHeadSelfAttention, transformer_encoder

from .harness import interleaved, table

D_MODEL, HEADS, CAPACITY = 128, 8, 512


def run() -> str:
    key = jax.random.PRNGKey(0)
    ours = MultiHeadSelfAttention(D_MODEL, HEADS, key, causal=True)
    prefix = jax.random.normal(jax.random.PRNGKey(1), (CAPACITY, D_MODEL))
    x_t = prefix[0]

    step = jax.jit(lambda m, x, cache: m.step(x, cache))
    cache = ours.init_cache(CAPACITY)
    for t in range(CAPACITY // 2):
        _, cache = step(ours, prefix[t], cache)

    flax_layer = nnx.MultiHeadAttention(
        num_heads=HEADS,
        in_features=D_MODEL,
        qkv_features=D_MODEL,
        use_bias=False,
        decode=True,
        rngs=nnx.Rngs(0),
    )
    flax_layer.init_cache((1, CAPACITY, D_MODEL))
    graphdef, state = nnx.split(flax_layer)

    @jax.jit
    def flax_step(state, x):
        layer = nnx.merge(graphdef, state)
        y = layer(x[None, None, :])
        return y, nnx.state(layer)

    for t in range(CAPACITY // 2):
        _, state = flax_step(state, prefix[t])

    recompute = jax.jit(lambda m, x: m(x)[-1])
    encoder = transformer_encoder(16, D_MODEL, HEADS, 512, 2, 10, key, CAPACITY, causal=True)
    enc_cache = encoder.init_cache(CAPACITY)
    enc_step = jax.jit(lambda m, x, cache: m.step(x, cache))
    x16 = jnp.ones((16,))
    for _ in range(CAPACITY // 2):
        _, enc_cache = enc_step(encoder, x16, enc_cache)

    medians = interleaved(
        {
            "dense_armor step (fixed cache)": lambda: step(ours, x_t, cache),
            "flax nnx decode": lambda: flax_step(state, x_t),
            "recompute causal forward, T=512": lambda: recompute(ours, prefix),
        },
        rounds=200,
    )
    encoder_step = interleaved({"encoder step, depth 2": lambda: enc_step(encoder, x16, enc_cache)})
    text = table(
        "Streaming: one causal self-attention step (d_model=128, 8 heads, capacity 512)",
        medians,
        "dense_armor step (fixed cache)",
    )
    ours_s = medians["dense_armor step (fixed cache)"]
    speedups = (
        f"\nspeed-up of the step: {medians['flax nnx decode'] / ours_s:.2f}x over flax nnx decode"
        f" (target >= 2x), {medians['recompute causal forward, T=512'] / ours_s:.1f}x over"
        " recompute (target >= 20x)"
    )
    return (
        text + speedups + f"\nwhole encoder step (d_model=128, depth 2, d_ff=512): "
        f"{encoder_step['encoder step, depth 2'] * 1e6:.1f} us"
    )


if __name__ == "__main__":
    print(run())
