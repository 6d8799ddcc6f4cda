"""The Llama lineage: Llama 2/3.x (`LlamaForCausalLM`), Mistral, Qwen2/2.5, Qwen3, Phi-3/4-mini,
OLMo 2 and StarCoder2. One table of tensor names with each architecture's differences said as
options: biases, per-head query/key norms (Qwen3) or norms over the projections (OLMo 2), norms
after the sub-layers (OLMo 2), fused `qkv_proj` and `gate_up_proj` (Phi-3), LayerNorm and the
two-layer MLP (StarCoder2), sliding windows by layer type."""

from collections.abc import Sequence
from typing import Any

from ._files import HuggingFaceError, option, refuse
from ._keys import with_changes
from ._tables import Table, per_layer
from .rope import LAYER_TYPES, rotary_options

__all__ = [
    "ARCHITECTURES", "DEFAULTS", "IGNORED", "arguments", "layer_windows", "per_layer_options",
    "table",
]  # fmt: skip

ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Olmo2ForCausalLM", "Starcoder2ForCausalLM", "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)  # fmt: skip
QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# The architectures whose attention reads `sliding_window` (transformers' Llama and OLMo 2 do not)
WINDOWED = ("MistralForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM", "MixtralForCausalLM")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_LLAMA = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0,
}  # fmt: skip
_QWEN = {
    "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
    "num_key_value_heads": 32, "use_sliding_window": False, "max_window_layers": 28,
}  # fmt: skip
# transformers 5's defaults of each architecture's config class: what a key left out of a
# config means (the hub's files leave many out). Applied under the config before it is read.
DEFAULTS = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": {**_LLAMA, "intermediate_size": 14336, "num_key_value_heads": 8,
                           "max_position_embeddings": 131072, "sliding_window": 4096},
    "MixtralForCausalLM": {**_LLAMA, "intermediate_size": 14336, "num_key_value_heads": 8,
                           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                           "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen2ForCausalLM": {**_LLAMA, **_QWEN},
    "Qwen3ForCausalLM": {**_LLAMA, **_QWEN, "head_dim": 128},
    "Qwen3MoeForCausalLM": {**_LLAMA, **_QWEN, "hidden_size": 2048, "intermediate_size": 6144,
                            "num_hidden_layers": 24, "num_key_value_heads": 4,
                            "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                            "num_experts": 128, "norm_topk_prob": False,
                            "decoder_sparse_step": 1},
    "Phi3ForCausalLM": {**_LLAMA, "vocab_size": 32064, "hidden_size": 3072,
                        "intermediate_size": 8192, "max_position_embeddings": 4096,
                        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "Olmo2ForCausalLM": {**_LLAMA, "vocab_size": 50304, "rms_norm_eps": 1e-5},
    "Starcoder2ForCausalLM": {**_LLAMA, "vocab_size": 49152, "hidden_size": 3072,
                              "intermediate_size": 12288, "num_hidden_layers": 30,
                              "num_attention_heads": 24, "num_key_value_heads": 2,
                              "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
                              "norm_epsilon": 1e-5, "use_bias": True,
                              "tie_word_embeddings": True},
}  # fmt: skip
# Keys the hub's files carry that the architecture's transformers model does not read
IGNORED = {
    "LlamaForCausalLM": ("sliding_window",),  # read by the windowed architectures only
    "Olmo2ForCausalLM": ("sliding_window",),
    # its LayerNorms read `norm_epsilon`, its projections `use_bias`
    "Starcoder2ForCausalLM": ("rms_norm_eps", "attention_bias"),
    "Qwen2ForCausalLM": ("attention_bias",),  # biases on the query, key and value always
    # transformers 5's Qwen3-MoE windows every layer when `use_sliding_window` (no
    # `max_window_layers`), which the hub's files carry from transformers 4
    "Qwen3MoeForCausalLM": ("max_window_layers",),
}


def check_layer_types(types: Any, depth: int) -> None:
    """`layer_types`: one of `LAYER_TYPES` per layer."""
    if not isinstance(types, list) or len(types) != depth or not set(types) <= set(LAYER_TYPES):
        raise HuggingFaceError(
            f"config.json: `layer_types` is {types!r}; expected {depth} of {LAYER_TYPES}."
        )


def layer_windows(config: dict[str, Any], depth: int) -> list[int | None]:
    """Each layer's window: `sliding_window` on the layers `layer_types` calls sliding (all of
    them when the config has no `layer_types` and a window, as Mistral's)."""
    window = option(config, "sliding_window", int, None)
    types = config.get("layer_types")
    if types is None:
        return [window] * depth
    check_layer_types(types, depth)
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
    windows: list[int | None] = [None] * depth
    if architecture in WINDOWED:
        windows = layer_windows(config, depth)
    if architecture in QWEN:
        config, windows = _qwen_windows(config, depth, architecture)
    shared, layers = per_layer_options(config, depth, windows, 1e4)
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


def _qwen_windows(
    config: dict[str, Any], depth: int, architecture: str
) -> tuple[dict[str, Any], list[int | None]]:
    """Qwen2/3's windows as transformers 5 reads them: `sliding_window` (4096 when absent) only
    with `use_sliding_window`, on the layers `layer_types` calls sliding, or without it on the
    layers from `max_window_layers` (28 when absent) on; Qwen3-MoE's on every layer. The config
    is returned with the derived `layer_types`."""
    use = option(config, "use_sliding_window", bool, False)
    window = config.get("sliding_window", 4096)
    window = window if use else None
    if window is not None:
        window = option({"sliding_window": window}, "sliding_window", int, None)
    if architecture == "Qwen3MoeForCausalLM":
        return config, [window] * depth
    start = option(config, "max_window_layers", int, 28)
    if config.get("layer_types") is not None:
        check_layer_types(config["layer_types"], depth)
    else:
        sliding = window is not None
        types = ["sliding_attention" if sliding and i >= start else "full_attention"
                 for i in range(depth)]  # fmt: skip
        config = with_changes(config, layer_types=types)
    if window is None:  # sliding layers without a window attend to every position
        return config, [None] * depth
    return config, layer_windows(with_changes(config, sliding_window=window), depth)


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
