"""Deep models: compile time and first-step time of the training step against depth (dense_armor
unrolled, dense_armor with `scan_layers=True`, Equinox's layers in a Python loop, Flax NNX's in a
Python loop); peak memory with and without `remat`; step time scanned against unrolled.

Training step: value_and_grad of the cross-entropy and an optax adam update, jitted; d_model 256,
8 heads, d_ff 1024, T 128, B 8, post-LN, float32. Compile time is `lower` + `compile` of the
step (after a warm-up compilation, the median of three, the systems in turn); the first step is
its first call after that. Memory is XLA's own `memory_analysis` of the
compiled step (temporaries), depth 12, T 2048, B 1, attention scores materialised.
"""

import os
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dense_armor.utility.neural import sinusoidal_positions, transformer_encoder

from .harness import interleaved, table

B, T, N_IN, D, H, D_FF, N_OUT = 8, 128, 16, 256, 8, 1024, 10
DEPTHS = (2, 8, 24)
# fewer on a machine lent for minutes (an accelerator): DENSE_ARMOR_BENCH_COMPILE_ROUNDS=1
COMPILE_ROUNDS = int(os.environ.get("DENSE_ARMOR_BENCH_COMPILE_ROUNDS", "3"))


def _loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class EquinoxEncoder(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, depth, key):
        keys = jax.random.split(key, 2 + 3 * depth)
        self.embed = eqx.nn.Linear(N_IN, D, key=keys[0])
        self.blocks = [
            (
                eqx.nn.MultiheadAttention(H, D, key=keys[2 + 3 * i]),
                eqx.nn.LayerNorm(D),
                eqx.nn.Linear(D, D_FF, key=keys[3 + 3 * i]),
                eqx.nn.Linear(D_FF, D, key=keys[4 + 3 * i]),
                eqx.nn.LayerNorm(D),
            )
            for i in range(depth)
        ]
        self.head = eqx.nn.Linear(D, N_OUT, key=keys[1])

    def __call__(self, x):
        h = jax.vmap(self.embed)(x) + sinusoidal_positions(T, D)
        for attention, norm1, hidden, out, norm2 in self.blocks:
            h = jax.vmap(norm1)(h + attention(h, h, h))
            h = jax.vmap(norm2)(h + jax.vmap(out)(jax.nn.relu(jax.vmap(hidden)(h))))
        return self.head(h.mean(axis=0))


class FlaxEncoder(nnx.Module):
    def __init__(self, depth, rngs):
        self.depth = depth
        self.embed = nnx.Linear(N_IN, D, rngs=rngs)
        self.attention = nnx.List(
            [
                nnx.MultiHeadAttention(H, D, use_bias=False, decode=False, rngs=rngs)
                for _ in range(depth)
            ]
        )
        self.norm1 = nnx.List([nnx.LayerNorm(D, rngs=rngs) for _ in range(depth)])
        self.norm2 = nnx.List([nnx.LayerNorm(D, rngs=rngs) for _ in range(depth)])
        self.hidden = nnx.List([nnx.Linear(D, D_FF, rngs=rngs) for _ in range(depth)])
        self.out = nnx.List([nnx.Linear(D_FF, D, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(D, N_OUT, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x) + sinusoidal_positions(T, D)
        for i in range(self.depth):
            h = self.norm1[i](h + self.attention[i](h))
            h = self.norm2[i](h + self.out[i](jax.nn.relu(self.hidden[i](h))))
        return self.head(h.mean(axis=1))


def _equinox_step(model, xs, labels):
    """(jitted step, its arguments) for an Equinox-style model (dense_armor's and Equinox's)."""
    optimizer = optax.adam(1e-3)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    def step(params, state, xs, labels):
        def loss(p):
            return _loss(jax.vmap(eqx.combine(p, static))(xs), labels)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return jax.jit(step), (params, state, xs, labels)


def _flax_step(model, xs, labels):
    optimizer = optax.adam(1e-3)
    graphdef, params = nnx.split(model, nnx.Param)
    state = optimizer.init(params)

    def step(params, state, xs, labels):
        def loss(p):
            return _loss(nnx.merge(graphdef, p)(xs), labels)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return jax.jit(step), (params, state, xs, labels)


def _compile(step, args):
    started = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return compiled, compile_s, time.perf_counter() - started


def _ours(depth, **options):
    return transformer_encoder(N_IN, D, H, D_FF, depth, N_OUT, jax.random.PRNGKey(0), T, **options)


def run() -> str:
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, T, N_IN))
    labels = jnp.arange(B) % N_OUT
    systems = {
        "dense_armor unrolled": lambda d: _equinox_step(_ours(d), xs, labels),
        "dense_armor scan_layers": lambda d: _equinox_step(_ours(d, scan_layers=True), xs, labels),
        "Equinox, Python loop": lambda d: _equinox_step(
            EquinoxEncoder(d, jax.random.PRNGKey(0)), xs, labels
        ),
        "Flax NNX, Python loop": lambda d: _flax_step(FlaxEncoder(d, nnx.Rngs(0)), xs, labels),
    }
    lines = [
        f"\ncompile time (lower + compile) and first step of the training step, d_model {D}, "
        f"{H} heads, T {T}, B {B}",
        f"{'system':<28}" + "".join(f"{'depth ' + str(d):>22}" for d in DEPTHS),
    ]
    # XLA's first compilation in a process pays its own start-up: a warm-up takes it.
    _compile(*systems["dense_armor unrolled"](1))
    compiled_steps, seconds = {}, {}
    # Each system and depth compiled COMPILE_ROUNDS times, the systems in turn; the median.
    for _ in range(COMPILE_ROUNDS):
        for depth in DEPTHS:
            for name, build in systems.items():
                step, args = build(depth)
                compiled, compile_s, first_s = _compile(step, args)
                compiled_steps[(name, depth)] = (compiled, args)
                seconds.setdefault((name, depth), []).append((compile_s, first_s))
    for name in systems:
        cells = []
        for depth in DEPTHS:
            compile_s = statistics.median(c for c, _ in seconds[(name, depth)])
            first_s = statistics.median(f for _, f in seconds[(name, depth)])
            cells.append(f"{compile_s:>9.2f} s {first_s * 1e3:>7.0f} ms")
        lines.append(f"{name:<28}" + "".join(f"{c:>22}" for c in cells))
    ratio = statistics.median(c for c, _ in seconds[("dense_armor scan_layers", 24)]) / (
        statistics.median(c for c, _ in seconds[("Equinox, Python loop", 24)])
    )
    lines.append(
        f"  scanned compile time at depth 24: {ratio:.2f}x Equinox's (goal: at most 0.25x)"
    )

    # step time, scanned against unrolled, at depth 8
    def runner(key):
        compiled, args = compiled_steps[(key, 8)]
        return lambda: compiled(*args)

    medians = interleaved(
        {name: runner(name) for name in ("dense_armor unrolled", "dense_armor scan_layers")},
        rounds=10,
        warmup=1,
    )
    lines.append(table("training step time at depth 8", medians, "dense_armor unrolled", "ms"))

    # peak memory (XLA's temporaries) with and without remat, depth 12, T 2048, B 1
    long_xs = jax.random.normal(jax.random.PRNGKey(2), (1, 2048, N_IN))
    lines.append("\ntraining step temporaries, depth 12, T 2048, B 1, scores materialised")
    base = None
    for remat in (None, "attention", "block"):
        model = transformer_encoder(
            N_IN, D, H, D_FF, 12, N_OUT, jax.random.PRNGKey(0), 2048,
            scan_layers=True, remat=remat, memory_efficient=False,
        )  # fmt: skip
        step, args = _equinox_step(model, long_xs, jnp.zeros(1, jnp.int32))
        temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
        base = base or temp
        lines.append(f"  remat={remat!s:<10} {temp / 2**30:>7.2f} GiB   {temp / base:.2f}x")
    return "\n".join(lines)
