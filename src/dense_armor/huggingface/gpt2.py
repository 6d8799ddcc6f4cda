"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm with biases, the MLP with the tanh GELU,
biases everywhere, fused `c_attn` in `Conv1D` layout (input rows, output columns), a tied head."""

from typing import Any

from ._files import option, refuse
from ._tables import Table, per_layer

__all__ = ["ARCHITECTURES", "DEFAULTS", "IGNORED", "arguments", "table"]

ARCHITECTURES = ("GPT2LMHeadModel",)
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# transformers 5's defaults of the config class: what a key left out of a config means
DEFAULTS = {
    "GPT2LMHeadModel": {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    }
}  # fmt: skip
# Keys the hub's files carry that transformers' GPT-2 does not read (`n_ctx`: the older
# spelling of `n_positions`, which is read)
IGNORED = {"GPT2LMHeadModel": ("n_ctx",)}


def arguments(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`TransformerLM`'s arguments for the config (options it does not build refused by name)."""
    refuse(
        config, "scale_attn_by_inverse_layer_idx", lambda v: not v, "attention scaled by 1/layer"
    )
    refuse(config, "scale_attn_weights", bool, "attention without the 1/sqrt(d_head) scale")
    refuse(config, "reorder_and_upcast_attn", lambda v: not v, "reordered attention")
    refuse(config, "add_cross_attention", lambda v: not v, "cross-attention")
    refuse(config, "activation_function", ACTIVATIONS.__contains__, "the MLP's activation")
    d_model = option(config, "n_embd", int, 768)
    return {
        "vocab": option(config, "vocab_size", int, 50257),
        "d_model": d_model,
        "n_heads": option(config, "n_head", int, 12),
        "d_ff": option(config, "n_inner", int, None) or 4 * d_model,
        "depth": option(config, "n_layer", int, 12),
        "max_len": option(config, "n_positions", int, 1024),
        "positions": "learned",
        "norm": "layer",
        "feed_forward": "mlp",
        "activation": ACTIVATIONS[config.get("activation_function", "gelu_new")],
        "eps": float(option(config, "layer_norm_epsilon", (int, float), 1e-5)),
        "tie_embeddings": option(config, "tie_word_embeddings", bool, True),
        "use_bias": True,
    }


def table(a: dict[str, Any], architecture: str) -> Table:
    """The checkpoint's tensor names, and the model weights each holds (all in `Conv1D`'s layout,
    which is the model's)."""
    p, b = "transformer.h.{i}.", "blocks.{i}."
    qkv = [b + f"attention.W_{n}" for n in "QKV"]
    rows = [
        (p + "attn.c_attn.weight", qkv, "plain"),
        (p + "attn.c_attn.bias", [w.replace("W_", "b_") for w in qkv], "plain"),
        (p + "attn.c_proj.weight", b + "attention.W_O", "plain"),
        (p + "attn.c_proj.bias", b + "attention.b_O", "plain"),
        (p + "ln_1.weight", b + "norm1.gain", "plain"),
        (p + "ln_1.bias", b + "norm1.bias", "plain"),
        (p + "ln_2.weight", b + "norm2.gain", "plain"),
        (p + "ln_2.bias", b + "norm2.bias", "plain"),
        (p + "mlp.c_fc.weight", b + "feed_forward.hidden.W", "plain"),
        (p + "mlp.c_fc.bias", b + "feed_forward.hidden.b", "plain"),
        (p + "mlp.c_proj.weight", b + "feed_forward.out.W", "plain"),
        (p + "mlp.c_proj.bias", b + "feed_forward.out.b", "plain"),
    ]
    return [
        *per_layer(1, [("transformer.wte.weight", "embed.table", "plain")]),
        *per_layer(1, [("transformer.wpe.weight", "positions.P", "plain")]),
        *per_layer(a["depth"], rows),
        *per_layer(1, [("transformer.ln_f.weight", "norm.gain", "plain")]),
        *per_layer(1, [("transformer.ln_f.bias", "norm.bias", "plain")]),
    ]
