"""Low-precision decoding on this CPU: a Llama-3.2-1B-shaped model (d_model 2048, 16 layers, 32
heads with 8 key/value heads, d_ff 8192, vocabulary 128256, a tied head; random weights, 1.24B
parameters) in float32, bfloat16, int8 weights (float32 tables as `quantize` leaves them,
bfloat16 tables, and with the tables in int8 too) and an int8 cache, against transformers
(PyTorch) in bfloat16 on the same shape.

Greedy `generate`, a prompt of `PROMPT` tokens and `NEW` new tokens, at batch 1 and 8: new tokens
per second over the whole call (prefill included), the first token's time (a call for one new
token), and the bytes of weights each holds. The systems' calls are interleaved (A B C ... A B C
...), the medians of `ROUNDS` whole generations. Each variant is cast or quantized from one
float32 model, all held at once (about 11 GB, and transformers' 2.5 GB).
"""

import gc
from collections.abc import Callable
from functools import partial

import jax
import numpy as np

from dense_armor.nn import precision
from dense_armor.nn.models.generation import generate
from dense_armor.nn.models.language_model import TransformerLM

from .bench_lm import torch_generate
from .harness import interleaved, record

LLAMA_1B = dict(vocab=128256, d_model=2048, n_heads=32, d_ff=8192, depth=16, max_len=2048)
KV_HEADS, ROPE_BASE = 8, 500000.0
PROMPT, NEW, ROUNDS, FIRST_ROUNDS = 32, 32, 3, 3
# what each row of the table holds: its weights (from the float32 model) and its cache
VARIANTS = {
    "float32": (lambda m: m, None),
    "bfloat16": (lambda m: precision.cast(m, "bfloat16"), None),
    "int8 weights, float32 tables": (lambda m: precision.quantize(m), None),  # the default
    "int8 weights, bf16 tables": (
        lambda m: precision.cast(precision.quantize(m), "bfloat16"),
        None,
    ),
    "int8 weights and tables": (lambda m: precision.quantize(m, embeddings=True), None),
    "float32, int8 cache": (lambda m: m, "int8"),
}


def _llama_1b() -> TransformerLM:
    a = LLAMA_1B
    return TransformerLM(
        a["vocab"], a["d_model"], a["n_heads"], a["d_ff"], a["depth"], jax.random.PRNGKey(0),
        a["max_len"], n_kv_heads=KV_HEADS, rope_base=ROPE_BASE,
    )  # fmt: skip


def _bytes(model: object) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model) if hasattr(leaf, "nbytes"))


def run() -> str:
    base = _llama_1b()
    models = {name: make(base) for name, (make, _) in VARIANTS.items()}
    del base
    gc.collect()
    sizes = {name: _bytes(m) for name, m in models.items()}
    rng = np.random.default_rng(0)
    lines = [
        "\nlow precision: Llama-3.2-1B shape (1.24B parameters, random weights), greedy, prompt "
        f"{PROMPT}, {NEW} new tokens (every system's calls interleaved)",
        f"{'system':<44}{'tokens/s':>10}{'first token ms':>16}{'weights GB':>12}",
    ]
    for batch in (1, 8):
        prompts = rng.integers(0, LLAMA_1B["vocab"], (batch, PROMPT)).astype(np.int32)
        runs: dict[str, Callable[[int], object]] = {
            name: partial(_ours, models[name], prompts, VARIANTS[name][1]) for name in models
        }
        runs.update(_transformers(prompts))
        whole = interleaved({n: partial(f, NEW) for n, f in runs.items()}, ROUNDS, warmup=1)
        first = interleaved({n: partial(f, 1) for n, f in runs.items()}, FIRST_ROUNDS, warmup=1)
        float_rate = batch * NEW / whole["float32"]
        for name in runs:
            rate = batch * NEW / whole[name]
            record(f"precision {name} B={batch}/per new token", 1 / rate)
            gb = sizes.get(name, 0) / 1e9 if name in sizes else _torch_bytes() / 1e9
            lines.append(
                f"{name + f', B={batch}':<44}{rate:>10.2f}{first[name] * 1e3:>16.1f}{gb:>12.2f}"
                f"   ({rate / float_rate:.2f}x float32's tokens/s)"
            )
        if "transformers bfloat16" not in runs:
            lines.append(
                f"{'transformers bfloat16':<44}   missing: torch and transformers not installed"
            )
    return "\n".join(lines)


def _ours(model: TransformerLM, prompts: np.ndarray, kv: str | None, new: int) -> object:
    return generate(model, prompts, new, kv_dtype=kv).tokens


_TORCH: dict[str, object] = {}


def _torch_bytes() -> int:
    model = _TORCH.get("model")
    return 0 if model is None else sum(p.numel() * p.element_size() for p in model.parameters())


def _transformers(prompts: np.ndarray) -> dict[str, Callable[[int], object]]:
    """transformers' `generate` (greedy, its KV cache on) on a `LlamaForCausalLM` of the same
    shape in bfloat16, random weights, as `{"transformers bfloat16": run}`; nothing where torch
    and transformers are not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return {}
    if "model" not in _TORCH:
        torch.manual_seed(0)
        a = LLAMA_1B
        config = transformers.LlamaConfig(
            vocab_size=a["vocab"], hidden_size=a["d_model"], intermediate_size=a["d_ff"],
            num_hidden_layers=a["depth"], num_attention_heads=a["n_heads"],
            num_key_value_heads=KV_HEADS, max_position_embeddings=a["max_len"],
            rope_theta=ROPE_BASE, tie_word_embeddings=True, dtype=torch.bfloat16,
        )  # fmt: skip
        _TORCH["model"] = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return {"transformers bfloat16": torch_generate(_TORCH["model"], prompts)}
