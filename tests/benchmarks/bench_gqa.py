"""Grouped-query attention and rotary positions: cache bytes and per-step latency of a causal
self-attention step at capacity 4096 (d_model 256, 8 query heads, half full) for 8, 2 and 1
key/value heads; and the training step (adam, jit) of the page-sized encoder (B 32, T 128,
d_model 128, 8 heads, depth 2) with rotary against sinusoidal positions. Interleaved."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from dense_armor.utility.neural import MultiHeadSelfAttention, transformer_encoder

from .harness import interleaved, table

D, HEADS, CAPACITY = 256, 8, 4096


def run() -> str:
    key = jax.random.PRNGKey(0)
    step = jax.jit(lambda m, x, cache: m.step(x, cache), donate_argnums=2)
    x = jax.random.normal(key, (D,))
    systems, lines = {}, []
    bytes_8 = None
    for n_kv in (8, 2, 1):
        layer = MultiHeadSelfAttention(D, HEADS, key, causal=True, n_kv_heads=n_kv)
        cache = layer.init_cache(CAPACITY)
        for _ in range(CAPACITY // 2):  # half full; compiles
            _, cache = step(layer, x, cache)
        size = cache.keys.nbytes + cache.values.nbytes
        bytes_8 = bytes_8 or size
        lines.append(
            f"  n_kv_heads={n_kv}: cache {size / 2**20:.1f} MiB ({size / bytes_8:.3f} of 8 heads)"
        )
        state = {"cache": cache}

        def one(layer=layer, state=state):
            y, state["cache"] = step(layer, x, state["cache"])
            return y

        systems[f"step, n_kv_heads={n_kv}"] = one
    medians = interleaved(systems, rounds=200, warmup=5)
    out = [
        table(
            f"causal self-attention step, d_model {D}, {HEADS} query heads, capacity {CAPACITY}",
            medians,
            "step, n_kv_heads=8",
        ),
        *lines,
    ]

    xs = jax.random.normal(key, (32, 128, 16))
    labels = jnp.arange(32) % 10
    optimizer = optax.adam(1e-3)

    def trainer(positions):
        model = transformer_encoder(16, 128, 8, 512, 2, 10, key, 128, positions=positions)
        params, static = eqx.partition(model, eqx.is_inexact_array)

        @jax.jit
        def train(params, state):
            def loss(p):
                logits = jax.vmap(eqx.combine(p, static))(xs)
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

            value, grads = jax.value_and_grad(loss)(params)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        state = optimizer.init(params)
        return lambda: train(params, state)

    medians = interleaved(
        {"sinusoidal positions": trainer("sinusoidal"), "rotary positions": trainer("rope")},
        rounds=10,
        warmup=1,
    )
    out.append(
        table(
            "encoder training step, B 32, T 128, d_model 128, 8 heads, depth 2",
            medians,
            "sinusoidal positions",
            "ms",
        )
    )
    return "\n".join(out)
