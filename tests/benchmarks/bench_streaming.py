"""Per-step latency of a causal self-attention decode loop with a fixed cache, against Flax NNX's
decode cache and against recomputing a causal forward over the whole prefix.

MultiHeadSelfAttention(d_model=128, n_heads=8, causal=True), capacity 512, batch 1, float32. Each
system runs its own idiomatic jitted loop and carries its state from step to step: dense_armor
steps a donated fixed cache; Flax NNX calls its `decode=True` layer through `nnx.split` /
`nnx.merge` in a jitted function (the state comes back, the cache updated); the recompute runs the
causal forward over the 512-step prefix. The loops are interleaved in rounds of 16 steps starting
half-way through the cache, each system leading the rounds in turn (the round after the
recompute starts with cold caches). dense_armor is timed three ways: its `Stream` (the library's
stepping loop: the model's and the cache's arrays held flat, the cache in the callback-free mode,
the overflow raised on the host before the step; each round reaches its first position by a
prefill and untimed steps), and the layer's `step` under the user's own `jax.jit` with the cache's
default `on_overflow="raise"` (`eqx.error_if`: a callback to Python compiled into the step, called
only when a step overflows) and with `on_overflow="nan"` (NaN rows and a flag, no callback: what
the exported step does). Also: the whole encoder's step (depth 2).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dense_armor.utility.neural import MultiHeadSelfAttention, Stream, transformer_encoder

from .harness import block, record, table

D_MODEL, HEADS, CAPACITY, ROUND = 128, 8, 512, 16


def run() -> str:
    key = jax.random.PRNGKey(0)
    ours = MultiHeadSelfAttention(D_MODEL, HEADS, key, causal=True)
    prefix = jax.random.normal(jax.random.PRNGKey(1), (CAPACITY, D_MODEL))
    # Rows sliced once: an eager `prefix[t]` inside the timed loops costs more than a step.
    rows = [jax.block_until_ready(prefix[t]) for t in range(CAPACITY)]

    step = jax.jit(lambda m, x, cache: m.step(x, cache), donate_argnums=2)
    flax_layer = nnx.MultiHeadAttention(
        num_heads=HEADS,
        in_features=D_MODEL,
        qkv_features=D_MODEL,
        use_bias=False,
        decode=True,
        rngs=nnx.Rngs(0),
    )
    flax_layer.init_cache((1, CAPACITY, D_MODEL))
    graphdef, flax_state = nnx.split(flax_layer)

    @jax.jit
    def flax_step(state, x):
        layer = nnx.merge(graphdef, state)
        y = layer(x[None, None, :])
        return y, nnx.state(layer)

    recompute = jax.jit(lambda m, x: m(x)[-1])

    half = CAPACITY // 2
    state = {
        "dense_armor step": ours.init_cache(CAPACITY),
        "dense_armor step, nan": ours.init_cache(CAPACITY, on_overflow="nan"),
        "flax": flax_state,
    }
    for t in range(half):  # fill half of every cache; compile
        for mode in ("dense_armor step", "dense_armor step, nan"):
            _, state[mode] = step(ours, rows[t], state[mode])
        _, state["flax"] = flax_step(state["flax"], rows[t])
    block(recompute(ours, prefix))
    start = dict(state)

    def ours_round(mode: str, t0: int) -> float:
        # each round restarts from the half-full caches, so every round times the same steps
        cache = jax.tree_util.tree_map(jnp.copy, start[mode])
        block(cache)
        tick = time.perf_counter()
        for t in range(t0, t0 + ROUND):
            y, cache = step(ours, rows[t], cache)
        block(y)
        return (time.perf_counter() - tick) / ROUND

    stream = Stream(ours, CAPACITY)

    def stream_round(t0: int) -> float:
        stream.reset()
        y = stream.prefill(prefix[:half])
        for t in range(half, t0):
            y = stream.step(rows[t])
        block(y)
        tick = time.perf_counter()
        for t in range(t0, t0 + ROUND):
            y = stream.step(rows[t])
        block(y)
        return (time.perf_counter() - tick) / ROUND

    def flax_round(t0: int) -> float:
        flax_cache = start["flax"]
        tick = time.perf_counter()
        for t in range(t0, t0 + ROUND):
            y, flax_cache = flax_step(flax_cache, rows[t])
        block(y)
        return (time.perf_counter() - tick) / ROUND

    def recompute_round(t0: int) -> float:
        tick = time.perf_counter()
        for _ in range(2):
            y = recompute(ours, prefix)
        block(y)
        return (time.perf_counter() - tick) / 2

    systems = [
        ("dense_armor stream", stream_round),
        ("dense_armor step", lambda t0: ours_round("dense_armor step", t0)),
        ("dense_armor step, nan", lambda t0: ours_round("dense_armor step, nan", t0)),
        ("flax nnx decode", flax_round),
        ("recompute", recompute_round),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _ in systems}
    for r in range(16):
        t0 = half + (r % 8) * ROUND
        # each system leads the round in turn: the one after the recompute starts with cold caches
        for name, run_round in systems[r % len(systems) :] + systems[: r % len(systems)]:
            samples[name].append(run_round(t0))
    medians = {name: float(np.median(v)) for name, v in samples.items()}

    encoder = transformer_encoder(16, D_MODEL, HEADS, 512, 2, 10, key, CAPACITY, causal=True)
    enc_step = jax.jit(lambda m, x, cache: m.step(x, cache), donate_argnums=2)
    enc_stream = Stream(encoder, CAPACITY)
    x16 = jnp.ones((16,))

    def encoder_timed(step_once) -> float:
        tick = time.perf_counter()
        for _ in range(32):
            y = step_once()
        block(y)
        return (time.perf_counter() - tick) / 32

    def encoder_round(r: int) -> tuple[float, float]:
        # both from half-full caches, 32 steps each; which goes first alternates by round
        state = {"cache": encoder.init_cache(CAPACITY)}
        enc_stream.reset()

        def jitted_once():
            y, state["cache"] = enc_step(encoder, x16, state["cache"])
            return y

        for _ in range(half):
            block((jitted_once(), enc_stream.step(x16)))
        if r % 2:
            streamed = encoder_timed(lambda: enc_stream.step(x16))
            return encoder_timed(jitted_once), streamed
        jitted = encoder_timed(jitted_once)
        return jitted, encoder_timed(lambda: enc_stream.step(x16))

    encoder_rounds = [encoder_round(r) for r in range(4)]
    encoder_us = float(np.median([r[0] for r in encoder_rounds])) * 1e6
    encoder_stream_us = float(np.median([r[1] for r in encoder_rounds])) * 1e6

    ours_s = medians["dense_armor stream"]
    for system, seconds in medians.items():
        record(f"streaming step/{system}", seconds)
    record("streaming step/whole encoder", encoder_us / 1e6)
    record("streaming step/whole encoder, stream", encoder_stream_us / 1e6)
    return (
        table(
            "Streaming: one causal self-attention step (d_model=128, 8 heads, capacity 512)",
            {
                "dense_armor Stream (fixed cache)": ours_s,
                "dense_armor step, jax.jit, 'raise'": medians["dense_armor step"],
                "dense_armor step, jax.jit, 'nan'": medians["dense_armor step, nan"],
                "flax nnx decode": medians["flax nnx decode"],
                "recompute causal forward, T=512": medians["recompute"],
            },
            "dense_armor Stream (fixed cache)",
        )
        + f"\nspeed-up of the step: {medians['flax nnx decode'] / ours_s:.2f}x over flax nnx "
        f"decode (target >= 3x), {medians['recompute'] / ours_s:.1f}x over recompute "
        "(target >= 20x); the layer's step under jax.jit: "
        f"{medians['flax nnx decode'] / medians['dense_armor step']:.2f}x with the default "
        f"on_overflow='raise', "
        f"{medians['flax nnx decode'] / medians['dense_armor step, nan']:.2f}x with 'nan'"
        + f"\nwhole encoder step (d_model=128, depth 2, d_ff=512): {encoder_stream_us:.1f} us "
        f"by its Stream, {encoder_us:.1f} us by its step under jax.jit"
    )


if __name__ == "__main__":
    print(run())
