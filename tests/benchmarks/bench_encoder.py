"""Encoder training step and forward against the same architecture built from Equinox and from
Flax NNX layers, and the exported artifacts against the jitted Python model.

B=32, T=128, n_in=16, d_model=128, 8 heads, d_ff=512, depth 2, n_out=10, float32, post-LN, no
attention biases, ReLU feed-forward, sinusoidal positions, mean over time; batch via vmap (Flax
NNX layers take the batch axis natively). Training step: value_and_grad of the cross-entropy and
an optax adam update, jitted: dense_armor's is `make_train_step`'s (which, on one CPU device,
runs a step whose temporaries exceed `CPU_STEP_BYTES` in micro-batches), the peers' the step
their documentation writes; dense_armor's model in that same one-batch step is timed beside
them. Also the achieved GFLOP/s (XLA's cost analysis of the compiled one-batch step) and the
fraction of a large float32 matmul's GFLOP/s on the same machine.
"""

import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dense_armor.checkpoints import ModelConfig, fill_tree, tree_arrays
from dense_armor.export import export_model, load
from dense_armor.training import make_train_step
from dense_armor.utility.neural import sinusoidal_positions

from .harness import interleaved, record, table

B, T, N_IN, D, H, D_FF, DEPTH, N_OUT = 32, 128, 16, 128, 8, 512, 2, 10
CONFIG = ModelConfig(
    "transformer_encoder",
    {
        "n_in": N_IN,
        "d_model": D,
        "n_heads": H,
        "d_ff": D_FF,
        "depth": DEPTH,
        "n_out": N_OUT,
        "max_len": T,
    },
)


class EquinoxEncoder(eqx.Module):
    embed: eqx.nn.Linear
    attention: list
    norms: list
    hidden: list
    out: list
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 2 + 3 * DEPTH)
        self.embed = eqx.nn.Linear(N_IN, D, key=keys[0])
        self.attention = [eqx.nn.MultiheadAttention(H, D, key=keys[2 + i]) for i in range(DEPTH)]
        self.norms = [(eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)) for _ in range(DEPTH)]
        self.hidden = [eqx.nn.Linear(D, D_FF, key=keys[2 + DEPTH + i]) for i in range(DEPTH)]
        self.out = [eqx.nn.Linear(D_FF, D, key=keys[2 + 2 * DEPTH + i]) for i in range(DEPTH)]
        self.head = eqx.nn.Linear(D, N_OUT, key=keys[1])

    def __call__(self, x):
        h = jax.vmap(self.embed)(x) + sinusoidal_positions(T, D)
        for attn, (n1, n2), w1, w2 in zip(
            self.attention, self.norms, self.hidden, self.out, strict=True
        ):
            h = jax.vmap(n1)(h + attn(h, h, h))
            ff = jax.vmap(w1)(h)
            h = jax.vmap(n2)(h + jax.vmap(w2)(jax.nn.relu(ff)))
        return self.head(h.mean(axis=0))


class FlaxEncoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(N_IN, D, rngs=rngs)
        self.attention = nnx.List(
            [
                nnx.MultiHeadAttention(H, D, use_bias=False, decode=False, rngs=rngs)
                for _ in range(DEPTH)
            ]
        )
        self.norm1 = nnx.List([nnx.LayerNorm(D, rngs=rngs) for _ in range(DEPTH)])
        self.norm2 = nnx.List([nnx.LayerNorm(D, rngs=rngs) for _ in range(DEPTH)])
        self.hidden = nnx.List([nnx.Linear(D, D_FF, rngs=rngs) for _ in range(DEPTH)])
        self.out = nnx.List([nnx.Linear(D_FF, D, rngs=rngs) for _ in range(DEPTH)])
        self.head = nnx.Linear(D, N_OUT, rngs=rngs)

    def __call__(self, x):  # (B, T, N_IN)
        h = self.embed(x) + sinusoidal_positions(T, D)
        for i in range(DEPTH):
            h = self.norm1[i](h + self.attention[i](h))
            h = self.norm2[i](h + self.out[i](jax.nn.relu(self.hidden[i](h))))
        return self.head(h.mean(axis=1))


def _loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _equinox_style(model, xs, labels):
    optimizer = optax.adam(1e-3)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    def train_fn(model, state, xs, labels):
        loss, grads = eqx.filter_value_and_grad(lambda m: _loss(jax.vmap(m)(xs), labels))(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    train = eqx.filter_jit(train_fn)
    forward = eqx.filter_jit(lambda m, xs: jax.vmap(m)(xs))
    return (lambda: train(model, state, xs, labels)), (lambda: forward(model, xs)), train_fn, state


def _flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis.get("flops", 0.0))


def _breakdown() -> dict[str, float]:
    """Seconds of the forward's unavoidable parts, each timed alone at the benchmark's shapes and
    multiplied by how often the forward runs it: the dense products (4 projections and the
    feed-forward's two per block), the attention's two batched products per block and its
    softmax. Their sum bounds how fast any implementation of this forward can be."""
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    x = jax.random.normal(keys[0], (B, T, D))
    w = jax.random.normal(keys[1], (D, D))
    w1, w2 = jax.random.normal(keys[2], (D, D_FF)), jax.random.normal(keys[3], (D_FF, D))
    heads = jax.random.normal(keys[4], (B, H, T, D // H))
    scores = jax.random.normal(keys[5], (B, H, T, T))
    projection = jax.jit(lambda x, w: x @ w)
    feed_forward = jax.jit(lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2)
    qk = jax.jit(lambda q, k: jnp.einsum("bhtd,bhsd->bhts", q, k))
    sv = jax.jit(lambda s, v: jnp.einsum("bhts,bhsd->bhtd", s, v))
    softmax = jax.jit(lambda s: jax.nn.softmax(s, axis=-1))
    parts = interleaved(
        {
            "projections": lambda: projection(x, w),
            "feed-forward": lambda: feed_forward(x, w1, w2),
            "attention products": lambda: (qk(heads, heads), sv(scores, heads)),
            "softmax": lambda: softmax(scores),
        },
        rounds=30,
    )
    counts = {"projections": 4 * DEPTH, "feed-forward": DEPTH}
    return {name: t * counts.get(name, DEPTH) for name, t in parts.items()}


def run() -> str:
    key = jax.random.PRNGKey(0)
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, T, N_IN))
    labels = jax.random.randint(jax.random.PRNGKey(2), (B,), 0, N_OUT)
    with jax.numpy_dtype_promotion("standard"):
        ours = CONFIG.build(key)
        ours_whole, ours_forward, ours_step, ours_state = _equinox_style(ours, xs, labels)
        library_step = make_train_step(optax.adam(1e-3))
        micro_batches = library_step.micro_batches(ours, ours_state, xs, labels)
        eqx_train, eqx_forward, _, _ = _equinox_style(EquinoxEncoder(key), xs, labels)

        flax_model = FlaxEncoder(nnx.Rngs(0))
        graphdef, params = nnx.split(flax_model, nnx.Param)
        optimizer = optax.adam(1e-3)
        opt_state = optimizer.init(params)

        @jax.jit
        def flax_train(params, opt_state):
            def loss_fn(p):
                return _loss(nnx.merge(graphdef, p)(xs), labels)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        flax_forward = jax.jit(lambda p: nnx.merge(graphdef, p)(xs))

        train = interleaved(
            {
                "dense_armor": lambda: library_step(ours, ours_state, xs, labels),
                "dense_armor, one batch": ours_whole,
                "equinox": eqx_train,
                "flax nnx": lambda: flax_train(params, opt_state),
            },
            rounds=15,
        )
        forward = interleaved(
            {
                "dense_armor": ours_forward,
                "equinox": eqx_forward,
                "flax nnx": lambda: flax_forward(params),
            },
            rounds=30,
        )
        step_flops = _flops(jax.jit(ours_step).lower(ours, ours_state, xs, labels).compile())
        big = jnp.ones((2048, 2048), jnp.float32)
        matmul = jax.jit(lambda a: a @ a)
        matmul_s = interleaved({"matmul": lambda: matmul(big)}, rounds=10)["matmul"]
        matmul_gflops = 2 * 2048**3 / matmul_s / 1e9
        ours_gflops = step_flops / train["dense_armor, one batch"] / 1e9

        with tempfile.TemporaryDirectory() as tmp:
            export_model(ours, CONFIG, f"{tmp}/art", platforms=["cpu"], static_shapes=[(1, T)])
            artifact = load(f"{tmp}/art")
            weights = artifact.weights
            exported_forward = jax.jit(artifact.functions["forward"].call)
            exported_step = jax.jit(artifact.functions["step"].call)
            causal = ModelConfig(CONFIG.factory, {**CONFIG.arguments, "causal": True})
            causal_model = fill_tree(causal.build(), tree_arrays(ours))
            python_cache = jax.tree_util.tree_map(
                lambda c: jnp.broadcast_to(c, (B, *c.shape)),
                causal_model.init_cache(T, on_overflow="nan"),
            )
            python_step = jax.jit(lambda m, x, c: jax.vmap(m.step)(x, c))
            python_forward = jax.jit(lambda m, x: jax.vmap(m)(x))
            exported_cache, x_t = artifact.init_cache(B), xs[:, 0]
            exported = interleaved(
                {
                    "python forward (jit)": lambda: python_forward(ours, xs),
                    "exported forward": lambda: exported_forward(weights, xs),
                    "python step (jit)": lambda: python_step(causal_model, x_t, python_cache),
                    "exported step": lambda: exported_step(weights, x_t, exported_cache),
                },
                rounds=30,
            )
        parts = _breakdown()
    for figure, medians in (("encoder training step", train), ("encoder forward", forward)):
        for system, seconds in medians.items():
            record(f"{figure}/{system}", seconds)
    for system, seconds in exported.items():
        record(f"exported/{system}", seconds)
    fastest_peer_train = min(train["equinox"], train["flax nnx"])
    fastest_peer_forward = min(forward["equinox"], forward["flax nnx"])
    lines = [
        table(
            "Encoder training step (B=32, T=128, d_model=128, depth 2)", train, "dense_armor", "ms"
        ),
        f"speed-up over the faster peer: {fastest_peer_train / train['dense_armor']:.2f}x "
        f"(target >= 1.25x); make_train_step ran the batch of {B} in {micro_batches} "
        f"micro-batch(es); in one batch, as the peers: "
        f"{fastest_peer_train / train['dense_armor, one batch']:.2f}x",
        f"one batch: {ours_gflops:.1f} GFLOP/s ({step_flops / 1e9:.2f} GFLOP per step); a 2048^2 "
        f"float32 matmul reaches {matmul_gflops:.1f} GFLOP/s: {ours_gflops / matmul_gflops:.0%}",
        table("Encoder forward (same shapes)", forward, "dense_armor", "ms"),
        f"speed-up over the faster peer: {fastest_peer_forward / forward['dense_armor']:.2f}x "
        "(target >= 1.25x)",
        "where a forward's time goes, each part timed alone at these shapes (ms): "
        + ", ".join(f"{name} {t * 1e3:.1f}" for name, t in parts.items())
        + f"; sum {sum(parts.values()) * 1e3:.1f}, against {fastest_peer_forward / 1.25 * 1e3:.1f}"
        " for 1.25x over the faster peer",
        table(
            "Exported functions vs the jitted Python model", exported, "python forward (jit)", "ms"
        ),
        "exported / python: forward "
        f"{exported['exported forward'] / exported['python forward (jit)']:.2f}x, step "
        f"{exported['exported step'] / exported['python step (jit)']:.2f}x (target <= 1.1x)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
