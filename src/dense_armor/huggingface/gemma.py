"""The Gemma family: Gemma (`GemmaForCausalLM`), Gemma 2 and Gemma 3's text model. Gemma's
conventions are options of the one model: the embedding scaled by `sqrt(hidden)`, RMSNorm scaled
by `1 + w`, the tanh GeGLU, a tied head; Gemma 2 and 3 add four norms per block, a query scale of
`query_pre_attn_scalar ** -0.5`, sliding and global layers (each kind its own rotary base in
Gemma 3), soft-capped scores and logits (Gemma 2) and per-head query/key norms (Gemma 3)."""

from typing import Any

from ._files import option, refuse
from ._tables import Table, per_layer
from .llama import layer_windows, per_layer_options

__all__ = ["ARCHITECTURES", "arguments", "table"]

ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
_THETA = {"GemmaForCausalLM": 10000.0, "Gemma2ForCausalLM": 10000.0, "Gemma3ForCausalLM": 1e6}


def _activation(config: dict[str, Any]) -> str:
    """Gemma's `hidden_activation`: the tanh GELU (transformers takes it for a missing one, and
    reads no `hidden_act`)."""
    name = config.get("hidden_activation") or "gelu_pytorch_tanh"
    refuse({"hidden_activation": name}, "hidden_activation",
           ("gelu_pytorch_tanh", "gelu_tanh").__contains__, "the GeGLU's activation")  # fmt: skip
    return "gelu_tanh"


def arguments(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`TransformerLM`'s arguments for the config (options it does not build refused by name)."""
    refuse(config, "use_bidirectional_attention", lambda v: not v, "bidirectional attention")
    refuse(config, "attention_bias", lambda v: not v, "biases on the projections")
    d_model = option(config, "hidden_size", int, 2048)
    n_heads = option(config, "num_attention_heads", int, 8)
    depth = option(config, "num_hidden_layers", int, 18)
    eps = float(option(config, "rms_norm_eps", (int, float), 1e-6))
    later = architecture != "GemmaForCausalLM"
    windows = layer_windows(config, depth) if later else [None] * depth
    shared, layers = per_layer_options(config, depth, windows, _THETA[architecture])
    result: dict[str, Any] = {
        "vocab": option(config, "vocab_size", int, 256000),
        "d_model": d_model,
        "n_heads": n_heads,
        "d_ff": option(config, "intermediate_size", int, 16384),
        "depth": depth,
        "max_len": option(config, "max_position_embeddings", int, 8192),
        "positions": "rope",
        **shared,
        "norm": "rms_plus_one",
        "feed_forward": "gated",
        "activation": _activation(config),
        "eps": eps,
        "tie_embeddings": option(config, "tie_word_embeddings", bool, True),
        "n_kv_heads": option(config, "num_key_value_heads", int, None) or n_heads,
        "head_dim": option(config, "head_dim", int, 256),
        "embed_scale": True,
    }
    if later:
        scalar = option(config, "query_pre_attn_scalar", (int, float), 256)
        result.update(norm_placement="both", query_scale=float(scalar) ** -0.5)
        softcap = option(config, "attn_logit_softcapping", (int, float), None)
        final = option(config, "final_logit_softcapping", (int, float), None)
        if softcap is not None:
            result["logit_softcap"] = float(softcap)
        if final is not None:
            result["final_logit_softcap"] = float(final)
    if architecture == "Gemma3ForCausalLM":
        result.update(qk_norm="head", qk_norm_eps=eps, qk_norm_plus_one=True)
    if layers is not None:
        result["layer_options"] = layers
    return result


def table(a: dict[str, Any], architecture: str) -> Table:
    """The checkpoint's tensor names, and the model weights each holds."""
    p, b = "model.layers.{i}.", "blocks.{i}."
    rows: list[tuple[str, str, str]] = [
        (p + f"self_attn.{n}_proj.weight", b + f"attention.W_{n.upper()}", "linear") for n in "qkvo"
    ]
    rows += [
        (p + f"mlp.{n}_proj.weight", b + f"feed_forward.W_{n}", "linear")
        for n in ("gate", "up", "down")
    ]
    rows.append((p + "input_layernorm.weight", b + "norm1.gain", "plain"))
    if architecture == "GemmaForCausalLM":
        rows.append((p + "post_attention_layernorm.weight", b + "norm2.gain", "plain"))
    else:  # four norms: around the attention, then around the MLP
        rows += [
            (p + "post_attention_layernorm.weight", b + "output_norms.0.gain", "plain"),
            (p + "pre_feedforward_layernorm.weight", b + "norm2.gain", "plain"),
            (p + "post_feedforward_layernorm.weight", b + "output_norms.1.gain", "plain"),
        ]
    if a.get("qk_norm"):
        rows += [
            (p + f"self_attn.{n}_norm.weight", b + f"attention.{n}_norm.gain", "plain")
            for n in "qk"
        ]
    return [
        *per_layer(1, [("model.embed_tokens.weight", "embed.table", "plain")]),
        *per_layer(a["depth"], rows),
        *per_layer(1, [("model.norm.weight", "norm.gain", "plain")]),
    ]
