"""The hybrids at long context: a Qwen3.5-shaped language model (three Gated DeltaNet layers to
one attention layer) against the same depth and width of attention layers alone, prompt 8192
tokens and 512 decoded: the prefill, the time per new token and the state's bytes; and one Gated
DeltaNet layer's chunked forward against its recurrence, step by step, over the same 8192 steps.
Each pair interleaved, jitted, on this machine's CPU."""

import equinox as eqx
import jax
import jax.numpy as jnp

from dense_armor.nn.mixers.deltanet import GatedDeltaNet
from dense_armor.nn.models.language_model import TransformerLM

from .harness import interleaved, record, table

VOCAB, D, HEADS, D_FF, DEPTH = 2048, 256, 4, 768, 8
PROMPT, NEW = 8192, 512
DELTA = {"n_heads": 4, "n_key_heads": 2, "key_dim": 64, "value_dim": 64}


def _models() -> dict[str, TransformerLM]:
    key = jax.random.PRNGKey(0)
    common = dict(n_kv_heads=2, head_dim=64)
    hybrid = TransformerLM(
        VOCAB, D, HEADS, D_FF, DEPTH, key, PROMPT + NEW,
        mixers=["gated_deltanet", "gated_deltanet", "gated_deltanet", "attention"] * 2,
        mixer_options={"gated_deltanet": DELTA}, output_gate=True, **common,
    )  # fmt: skip
    attention = TransformerLM(VOCAB, D, HEADS, D_FF, DEPTH, key, PROMPT + NEW, **common)
    return {"hybrid (6 Gated DeltaNet, 2 attention)": hybrid, "attention (8 layers)": attention}


@eqx.filter_jit
def _prefill(model: TransformerLM, ids: jax.Array) -> tuple[jax.Array, object]:
    return model.prefill_last(ids, model.init_cache(PROMPT + NEW))


@eqx.filter_jit
def _decode(model: TransformerLM, cache: object, token: jax.Array) -> jax.Array:
    def one(carry: tuple, _: None) -> tuple:
        cache, token = carry
        logits, cache = model.step(token, cache)
        return (cache, jnp.argmax(logits).astype(jnp.int32)), None

    (_, token), _ = jax.lax.scan(one, (cache, token), None, length=NEW)
    return token


def _bytes(tree: object) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def _language_models() -> list[str]:
    models = _models()
    ids = jax.random.randint(jax.random.PRNGKey(1), (PROMPT,), 0, VOCAB)
    prefills = {name: (lambda m=m: _prefill(m, ids)) for name, m in models.items()}
    after = {name: _prefill(m, ids)[1] for name, m in models.items()}
    token = jnp.asarray(1, jnp.int32)
    decodes = {
        name: (lambda m=m, n=name: _decode(m, after[n], token)) for name, m in models.items()
    }
    first = interleaved(prefills, rounds=3, warmup=1)
    per = {name: s / NEW for name, s in interleaved(decodes, rounds=3, warmup=1).items()}
    names = list(models)
    for name in names:
        short = "hybrid" if name.startswith("hybrid") else "attention"
        record(f"hybrid lm/{short} prefill {PROMPT}", first[name])
        record(f"hybrid lm/{short} per new token", per[name])
    states = {name: _bytes(after[name][1]) for name in names}
    hybrid, attention = names
    return [
        table(f"prefill of {PROMPT} tokens (d_model {D}, depth {DEPTH})", first, attention, "ms"),
        table(f"decoding after it, per new token ({NEW} tokens)", per, attention, "ms"),
        f"  state after the prompt: {states[hybrid] / 2**20:.1f} MiB (hybrid) against "
        f"{states[attention] / 2**20:.1f} MiB (attention), "
        f"{states[attention] / states[hybrid]:.1f}x less; the hybrid prefills in "
        f"{first[hybrid] / first[attention]:.2f}x and decodes in "
        f"{per[hybrid] / per[attention]:.2f}x the attention model's time",
    ]


def _layer() -> list[str]:
    options = {k: v for k, v in DELTA.items() if k != "n_heads"}
    layer = GatedDeltaNet(D, DELTA["n_heads"], jax.random.PRNGKey(2), **options)
    xs = jax.random.normal(jax.random.PRNGKey(3), (PROMPT, D))
    chunked = eqx.filter_jit(lambda m, xs: m(xs))

    @eqx.filter_jit
    def recurrent(m: GatedDeltaNet, xs: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, x_t: m.step(x_t, c)[::-1], m.init_cache(), xs)[1]

    name = f"chunked forward (chunks of {layer.chunk})"
    systems = {
        name: lambda: chunked(layer, xs),
        "the recurrence, step by step": lambda: recurrent(layer, xs),
    }
    medians = interleaved(systems, rounds=3, warmup=1)
    record("hybrid layer/chunked forward", medians[name])
    record("hybrid layer/recurrent steps", medians["the recurrence, step by step"])
    title = f"one Gated DeltaNet layer over {PROMPT} steps (d_model {D}, 4 heads of 64)"
    return [table(title, medians, name, "ms")]


def run() -> str:
    return "\n".join([*_language_models(), *_layer()])
