"""The Llama lineage: Llama 2/3.x (`LlamaForCausalLM`), Mistral, Qwen2/2.5, Qwen3, Phi-3/4-mini,
OLMo 2 and StarCoder2. One table of tensor names with each architecture's differences said as
options: biases, per-head query/key norms (Qwen3) or norms over the projections (OLMo 2), norms
after the sub-layers (OLMo 2), fused `qkv_proj` and `gate_up_proj` (Phi-3), LayerNorm and the
two-layer MLP (StarCoder2), sliding windows by layer type."""

from collections.abc import Sequence
from typing import Any

from ._files import HuggingFaceError, option, refuse
from ._tables import Table, per_layer
from .rope import LAYER_TYPES, rotary_options

__all__ = ["ARCHITECTURES", "arguments", "layer_windows", "per_layer_options", "table"]

ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Olmo2ForCausalLM", "Starcoder2ForCausalLM", "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)  # fmt: skip
QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# The architectures whose attention reads `sliding_window` (transformers' Llama and OLMo 2 do not)
WINDOWED = ("MistralForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM", "MixtralForCausalLM")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def layer_windows(config: dict[str, Any], depth: int) -> list[int | None]:
    """Each layer's window: `sliding_window` on the layers `layer_types` calls sliding (all of
    them when the config has no `layer_types` and a window, as Mistral's)."""
    window = option(config, "sliding_window", int, None)
    types = config.get("layer_types")
    if types is None:
        return [window] * depth
    if not isinstance(types, list) or len(types) != depth or not set(types) <= set(LAYER_TYPES):
        raise HuggingFaceError(
            f"config.json: `layer_types` is {types!r}; expected {depth} of {LAYER_TYPES}."
        )
    if "sliding_attention" in types and window is None:
        raise HuggingFaceError(
            "config.json: sliding layers in `layer_types` but no `sliding_window`."
        )
    return [window if kind == "sliding_attention" else None for kind in types]


def per_layer_options(
    config: dict[str, Any], depth: int, windows: Sequence[int | None], default_theta: float
) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """The attention options every layer shares, and each layer's own (or `None` when all
    layers are alike): windows and, per layer type, the rotary positions."""
    types = config.get("layer_types") or ["full_attention"] * depth
    layers = [
        {**rotary_options(config, kind, default_theta), **({"window": w} if w else {})}
        for kind, w in zip(types, windows, strict=True)
    ]
    if all(layer == layers[0] for layer in layers):
        return layers[0], None
    return {}, layers


def arguments(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`TransformerLM`'s arguments for the config (options it does not build refused by name)."""
    refuse(config, "mlp_bias", lambda v: not v, "biases in the MLP")
    refuse(config, "hidden_act", ACTIVATIONS.__contains__, "the MLP's activation")
    d_model = option(config, "hidden_size", int, 4096)
    n_heads = option(config, "num_attention_heads", int, 32)
    depth = option(config, "num_hidden_layers", int, 32)
    head_dim = option(config, "head_dim", int, None) or d_model // n_heads
    qwen2, star = architecture == "Qwen2ForCausalLM", architecture == "Starcoder2ForCausalLM"
    windows = layer_windows(config, depth) if architecture in WINDOWED else [None] * depth
    if architecture in QWEN:
        windows = _qwen_windows(config, depth)
    shared, layers = per_layer_options(config, depth, windows, 10000.0)
    result: dict[str, Any] = {
        "vocab": option(config, "vocab_size", int, 32000),
        "d_model": d_model,
        "n_heads": n_heads,
        "d_ff": option(config, "intermediate_size", int, 11008),
        "depth": depth,
        "max_len": option(config, "max_position_embeddings", int, 2048),
        "positions": "rope",
        **shared,
        "norm": "layer" if star else "rms",
        "feed_forward": "mlp" if star else "gated",
        "activation": ACTIVATIONS[config.get("hidden_act", "silu")],
        "eps": float(
            option(config, "norm_epsilon" if star else "rms_norm_eps", (int, float), 1e-6)
        ),
        "tie_embeddings": option(config, "tie_word_embeddings", bool, star),
        "n_kv_heads": option(config, "num_key_value_heads", int, None) or n_heads,
        "use_bias": qwen2 or bool(config.get("use_bias" if star else "attention_bias", False)),
    }
    if head_dim != d_model // n_heads or d_model % n_heads:
        result["head_dim"] = head_dim
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        result.update(qk_norm="head", qk_norm_eps=result["eps"])
    if architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        result.update(_experts(config, architecture))
    if architecture == "Olmo2ForCausalLM":
        result.update(qk_norm="projection", qk_norm_eps=result["eps"], norm_placement="output")
    if layers is not None:
        result["layer_options"] = layers
    return result


def _experts(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """A mixture of experts' arguments: every layer's feed-forward sparse (Qwen3-MoE's dense
    layers, `mlp_only_layers` or `decoder_sparse_step` other than 1, are refused)."""
    if architecture == "MixtralForCausalLM":
        return {
            "feed_forward": "moe",
            "n_experts": option(config, "num_local_experts", int, 8),
            "top_k": option(config, "num_experts_per_tok", int, 2),
        }
    refuse(config, "mlp_only_layers", lambda v: not v, "dense MLP layers among the sparse ones")
    refuse(config, "decoder_sparse_step", lambda v: v == 1, "sparse layers every few layers")
    return {
        "feed_forward": "moe",
        "d_ff": option(config, "moe_intermediate_size", int, 768),
        # transformers 5 saves `num_local_experts`; the hub's configs say `num_experts`
        "n_experts": option(config, "num_local_experts", int, None)
        or option(config, "num_experts", int, 128),
        "top_k": option(config, "num_experts_per_tok", int, 8),
        "normalize_top_k": option(config, "norm_topk_prob", bool, False),
    }


def _qwen_windows(config: dict[str, Any], depth: int) -> list[int | None]:
    """Qwen2/3's windows: with `use_sliding_window`, the layers from `max_window_layers` on (as
    transformers' `layer_types` says for configs that carry it)."""
    if config.get("layer_types") is not None:
        return layer_windows(config, depth)
    if not config.get("use_sliding_window", False):
        return [None] * depth
    window = option(config, "sliding_window", int, 4096)
    start = option(config, "max_window_layers", int, depth)
    return [window if i >= start else None for i in range(depth)]


def table(a: dict[str, Any], architecture: str) -> Table:
    """The checkpoint's tensor names, and the model weights each holds."""
    attention, mlp = "blocks.{i}.attention.", "blocks.{i}.feed_forward."
    p = "model.layers.{i}."
    rows: list[tuple[str, Any, str]] = []
    if architecture == "Phi3ForCausalLM":
        rows.append(
            (
                p + "self_attn.qkv_proj.weight",
                [attention + w for w in ("W_Q", "W_K", "W_V")],
                "linear",
            )
        )
    else:
        rows += [
            (p + f"self_attn.{n}_proj.weight", attention + f"W_{n.upper()}", "linear")
            for n in "qkv"
        ]
    rows.append((p + "self_attn.o_proj.weight", attention + "W_O", "linear"))
    if a["use_bias"]:
        rows += [
            (p + f"self_attn.{n}_proj.bias", attention + f"b_{n.upper()}", "plain") for n in "qkv"
        ]
        qwen2 = architecture == "Qwen2ForCausalLM"  # Qwen2's has none: zeros in the model
        rows.append(
            (p + "self_attn.o_proj.bias", attention + "b_O", "plain?" if qwen2 else "plain")
        )
    if a.get("qk_norm"):
        rows += [
            (p + f"self_attn.{n}_norm.weight", attention + f"{n}_norm.gain", "plain") for n in "qk"
        ]
    rows += _norm_rows(a, architecture)
    rows += _mlp_rows(architecture, mlp)
    return [
        *per_layer(1, [("model.embed_tokens.weight", "embed.table", "plain")]),
        *per_layer(a["depth"], rows, a.get("n_experts") or 0),
        *per_layer(1, [("model.norm.weight", "norm.gain", "plain")]),
        *(
            per_layer(1, [("model.norm.bias", "norm.bias", "plain")])
            if a["norm"] == "layer"
            else []
        ),
    ]


def _norm_rows(a: dict[str, Any], architecture: str) -> list[tuple[str, str, str]]:
    p, b = "model.layers.{i}.", "blocks.{i}."
    if architecture == "Olmo2ForCausalLM":  # the norms on the sub-layers' outputs
        names = ("post_attention_layernorm", "post_feedforward_layernorm")
    else:
        names = ("input_layernorm", "post_attention_layernorm")
    pairs = list(zip("12", names, strict=True))
    rows = [(p + f"{n}.weight", b + f"norm{k}.gain", "plain") for k, n in pairs]
    if a["norm"] == "layer":
        rows += [(p + f"{n}.bias", b + f"norm{k}.bias", "plain") for k, n in pairs]
    return rows


def _mlp_rows(architecture: str, mlp: str) -> list[tuple[str, Any, str]]:
    p = "model.layers.{i}.mlp."
    if architecture == "MixtralForCausalLM":  # experts' w1 gate, w3 up, w2 down
        p = "model.layers.{i}.block_sparse_moe."
        names = (("w1", "W_gate"), ("w3", "W_up"), ("w2", "W_down"))
        return [(p + "gate.weight", mlp + "router", "linear")] + [
            (p + f"experts.{{j}}.{n}.weight", mlp + w, "linear") for n, w in names
        ]
    if architecture == "Qwen3MoeForCausalLM":
        names = (("gate_proj", "W_gate"), ("up_proj", "W_up"), ("down_proj", "W_down"))
        return [(p + "gate.weight", mlp + "router", "linear")] + [
            (p + f"experts.{{j}}.{n}.weight", mlp + w, "linear") for n, w in names
        ]
    if architecture == "Phi3ForCausalLM":
        return [
            (p + "gate_up_proj.weight", [mlp + "W_gate", mlp + "W_up"], "linear"),
            (p + "down_proj.weight", mlp + "W_down", "linear"),
        ]
    if architecture == "Starcoder2ForCausalLM":
        return [
            (p + "c_fc.weight", mlp + "hidden.W", "linear"),
            (p + "c_fc.bias", mlp + "hidden.b", "plain"),
            (p + "c_proj.weight", mlp + "out.W", "linear"),
            (p + "c_proj.bias", mlp + "out.b", "plain"),
        ]
    return [(p + f"{n}_proj.weight", mlp + f"W_{n}", "linear") for n in ("gate", "up", "down")]
