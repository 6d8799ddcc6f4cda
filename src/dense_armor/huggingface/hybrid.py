"""The hybrids: LFM2 (`Lfm2ForCausalLM`: short gated convolutions among attention layers) and
Qwen3.5's text models (`Qwen3_5ForCausalLM`: Gated DeltaNet layers, full attention every
`full_attention_interval`-th; `Qwen3_5MoeForCausalLM`: the same layers, each feed-forward a
mixture of experts with a gated shared expert). Each is options of the one model: `mixers` (one
per layer, from the config's `layer_types`) and `mixer_options`, beside the attention's options
(LFM2's per-head query/key norms; Qwen3.5's `1 + w` norms, output gate and partial rotary
positions), and a table of tensors per kind of layer. `config` writes the arguments back as a
config."""

import math
from collections.abc import Mapping
from typing import Any

from ._files import HuggingFaceError, option, refuse
from ._keys import with_changes
from ._tables import Table, per_layer
from .rope import rotary_options

__all__ = ["ARCHITECTURES", "DEFAULTS", "IGNORED", "arguments", "config", "table"]

ARCHITECTURES = ("Lfm2ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
LFM2, QWEN35, QWEN35_MOE = ARCHITECTURES
# Each architecture's layer types, and the mixer of each.
KINDS = {
    LFM2: {"conv": "short_conv", "full_attention": "attention"},
    QWEN35: {"linear_attention": "gated_deltanet", "full_attention": "attention"},
}
KINDS[QWEN35_MOE] = KINDS[QWEN35]
# Keys the hub's files carry that the architecture's transformers model does not read: LFM2's
# norms read `norm_eps`, and its first releases' files carry their own spellings beside
# transformers' (`theta`, `num_heads`, `block_dim`, ...), which transformers never reads
IGNORED = {
    LFM2: ("rms_norm_eps", "theta", "num_heads", "block_dim", "block_norm_eps", "conv_dim",
           "conv_dim_out", "use_pos_enc", "block_use_swiglu", "block_mlp_init_scale",
           "block_out_init_scale", "block_use_xavier_init", "conv_use_xavier_init"),
}  # fmt: skip
_QWEN35 = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}  # fmt: skip
# transformers 5's defaults of each architecture's config class: what a key left out of a
# config means (the hub's files leave many out). Applied under the config before it is read.
DEFAULTS = {
    LFM2: {"vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 128000, "norm_eps": 1e-5, "tie_word_embeddings": True,
           "rope_theta": 1e6, "conv_bias": False, "conv_L_cache": 3, "block_multiple_of": 256,
           "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True},
    QWEN35: _QWEN35,
    QWEN35_MOE: {**_QWEN35, "hidden_size": 2048, "num_hidden_layers": 40,
                 "num_key_value_heads": 2, "moe_intermediate_size": 512,
                 "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8,
                 "num_experts": 256},
}  # fmt: skip


def _layer_types(config: dict[str, Any], architecture: str, depth: int) -> list[str]:
    """`layer_types`, or what transformers derives without it (LFM2's `full_attn_idxs`, all
    layers attention when absent; Qwen3.5's every `full_attention_interval`-th, 4 when absent);
    with it, transformers reads neither of those, and nor does this."""
    types = config.get("layer_types")
    older = "full_attn_idxs" if architecture == LFM2 else "full_attention_interval"
    if types is not None:
        config.get(older)  # read, and left to `layer_types` as transformers leaves it
    if types is None and architecture == LFM2:
        full = config.get("full_attn_idxs")
        full = list(range(depth)) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(depth)]
    elif types is None:
        every = option(config, "full_attention_interval", int, 4)
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(depth)
        ]
    kinds = KINDS[architecture]
    if not isinstance(types, list) or len(types) != depth or not set(types) <= set(kinds):
        raise HuggingFaceError(
            f"config.json: `layer_types` is {types!r}; expected {depth} of {tuple(kinds)}."
        )
    return types


def _lfm2_d_ff(config: dict[str, Any]) -> int:
    """LFM2's feed-forward width: `intermediate_size` (`block_ff_dim`), adjusted as `Lfm2MLP`
    adjusts it (two thirds, times the multiplier, up to a multiple of `block_multiple_of`)."""
    stated = option(config, "intermediate_size", int, 12288)
    d_ff = option(config, "block_ff_dim", int, None) or stated  # the older key wins
    if not option(config, "block_auto_adjust_ff_dim", bool, True):
        return d_ff
    d_ff = int(2 * d_ff / 3)
    multiplier = option(config, "block_ffn_dim_multiplier", (int, float), 1.0)
    if multiplier is not None:
        d_ff = int(multiplier * d_ff)
        multiple = option(config, "block_multiple_of", int, 256)
        d_ff = multiple * ((d_ff + multiple - 1) // multiple)
    return d_ff


def _rope(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The rotary options; Qwen3.5's multimodal sections are dropped: a text's positions are the
    same on the three axes, so its rotation is the plain one."""
    if architecture != LFM2 and isinstance(config.get("rope_parameters"), dict):
        parameters = dict(config["rope_parameters"])
        for name in ("mrope_section", "mrope_interleaved"):
            parameters.pop(name, None)
        config = with_changes(config, rope_parameters=parameters)
    return rotary_options(config, None)  # the base's default: DEFAULTS


def arguments(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`TransformerLM`'s arguments for the config (options it does not build refused by name)."""
    lfm2 = architecture == LFM2
    refuse(config, "hidden_act", "silu".__eq__, "the MLP's and the convolution's activation")
    refuse(config, "attention_bias", lambda v: not v, "biases on the projections")
    d_model = option(config, "hidden_size", int, 2560 if lfm2 else 4096)
    n_heads = option(config, "num_attention_heads", int, 32 if lfm2 else 16)
    depth = option(config, "num_hidden_layers", int, 32)
    eps = float(option(config, "norm_eps" if lfm2 else "rms_norm_eps", (int, float), 1e-5))
    types = _layer_types(config, architecture, depth)
    tied = config.get("tie_embedding", config.get("tie_word_embeddings", lfm2))
    result: dict[str, Any] = {
        "vocab": option(config, "vocab_size", int, 65536 if lfm2 else 248320),
        "d_model": d_model,
        "n_heads": n_heads,
        "d_ff": _lfm2_d_ff(config) if lfm2 else option(config, "intermediate_size", int, 12288),
        "depth": depth,
        "max_len": option(config, "max_position_embeddings", int, 128000 if lfm2 else 32768),
        "positions": "rope",
        **_rope(config, architecture),
        "norm": "rms" if lfm2 else "rms_plus_one",
        "feed_forward": "gated",
        "activation": "silu",
        "eps": eps,
        "tie_embeddings": option({"tied": tied}, "tied", bool, lfm2),
        "n_kv_heads": option(config, "num_key_value_heads", int, None) or n_heads,
        "qk_norm": "head",
        "qk_norm_eps": eps,
        "mixers": [KINDS[architecture][kind] for kind in types],
    }
    head_dim = option(config, "head_dim", int, None) or (d_model // n_heads if lfm2 else 256)
    if head_dim != d_model // n_heads or d_model % n_heads:
        result["head_dim"] = head_dim
    if lfm2:
        kernel, bias = (
            option(config, "conv_L_cache", int, 3),
            option(config, "conv_bias", bool, False),
        )
        if "short_conv" in result["mixers"]:
            result["mixer_options"] = {"short_conv": {"kernel": kernel, "use_bias": bias}}
        return result
    result.update(qk_norm_plus_one=True, output_gate=True)
    if architecture == QWEN35_MOE:
        result.update(_experts(config))
    if "gated_deltanet" in result["mixers"]:
        result["mixer_options"] = {"gated_deltanet": _delta_net(config, eps)}
    return result


def _experts(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's feed-forward: every layer's a mixture of experts (renormalised over the
    chosen) and a shared expert gated by a sigmoid."""
    refuse(config, "norm_topk_prob", True.__eq__, "experts' weights not renormalised")
    return {
        "feed_forward": "moe",
        "d_ff": option(config, "moe_intermediate_size", int, 512),
        "n_experts": option(config, "num_experts", int, 256),
        "top_k": option(config, "num_experts_per_tok", int, 8),
        "shared_d_ff": option(config, "shared_expert_intermediate_size", int, 512),
    }


def _delta_net(config: dict[str, Any], eps: float) -> dict[str, Any]:
    return {
        "n_heads": option(config, "linear_num_value_heads", int, 32),
        "n_key_heads": option(config, "linear_num_key_heads", int, 16),
        "key_dim": option(config, "linear_key_head_dim", int, 128),
        "value_dim": option(config, "linear_value_head_dim", int, 128),
        "kernel": option(config, "linear_conv_kernel_dim", int, 4),
        "eps": eps,
    }


Rows = list[tuple[str, Any, str]]


def _attention_rows(a: dict[str, Any], architecture: str) -> Rows:
    p, m = "model.layers.{i}.self_attn.", "blocks.{i}.attention."
    if architecture == LFM2:
        names = (("q_proj", "W_Q"), ("k_proj", "W_K"), ("v_proj", "W_V"), ("out_proj", "W_O"))
        norms = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))
        plain: Rows = [(p + f"{n}.weight", m + w, "linear") for n, w in names]
        return plain + [(p + f"{n}.weight", m + f"{w}.gain", "plain") for n, w in norms]
    rows: Rows = [(p + "q_proj.weight", [m + "W_Q", m + "W_G"], f"linear:{a['n_heads']}")]
    rows += [(p + f"{n}_proj.weight", m + f"W_{n.upper()}", "linear") for n in "kvo"]
    return rows + [(p + f"{n}_norm.weight", m + f"{n}_norm.gain", "plain") for n in "qk"]


def _mixer_rows(a: dict[str, Any], architecture: str) -> Rows:
    m = "blocks.{i}.recurrent."
    if architecture == LFM2:
        p = "model.layers.{i}.conv."
        rows = [
            (p + "in_proj.weight", m + "W_in", "linear"),
            (p + "conv.weight", m + "conv", "conv"),
            (p + "out_proj.weight", m + "W_out", "linear"),
        ]
        if a["mixer_options"]["short_conv"]["use_bias"]:
            names = (("in_proj", "b_in"), ("conv", "b_conv"), ("out_proj", "b_out"))
            rows += [(p + f"{n}.bias", m + w, "plain") for n, w in names]
        return rows
    p = "model.layers.{i}.linear_attn."
    linear = [("in_proj_qkv", "W_qkv"), ("in_proj_z", "W_z"), ("in_proj_b", "W_b")]
    linear += [("in_proj_a", "W_a"), ("out_proj", "W_out")]
    plain = (("A_log", "A_log"), ("dt_bias", "dt_bias"), ("norm.weight", "norm_gain"))
    return [
        *((p + f"{n}.weight", m + w, "linear") for n, w in linear),
        (p + "conv1d.weight", m + "conv", "conv"),
        *((p + n, m + w, "plain") for n, w in plain),
    ]


def _expert_rows() -> Rows:
    p, m = "model.layers.{i}.mlp.", "blocks.{i}.feed_forward."
    names = ("gate", "up", "down")
    return [
        (p + "gate.weight", m + "router", "linear"),
        *((p + f"experts.{{j}}.{n}_proj.weight", m + f"W_{n}", "linear") for n in names),
        *((p + f"shared_expert.{n}_proj.weight", m + f"shared.W_{n}", "linear") for n in names),
        (p + "shared_expert_gate.weight", m + "shared_gate", "linear"),
    ]


def table(a: dict[str, Any], architecture: str) -> Table:
    """The checkpoint's tensor names, and the model weights each holds, layer by layer."""
    lfm2 = architecture == LFM2
    p, b = "model.layers.{i}.", "blocks.{i}."
    norms = (
        ("operator_norm", "ffn_norm") if lfm2 else ("input_layernorm", "post_attention_layernorm")
    )
    shared = [
        (p + f"{n}.weight", b + f"norm{k}.gain", "plain") for k, n in zip("12", norms, strict=True)
    ]
    if lfm2:
        names = (("w1", "W_gate"), ("w3", "W_up"), ("w2", "W_down"))
        shared += [
            (p + f"feed_forward.{n}.weight", b + f"feed_forward.{w}", "linear") for n, w in names
        ]
    elif architecture == QWEN35_MOE:
        shared += _expert_rows()
    else:
        shared += [
            (p + f"mlp.{n}_proj.weight", b + f"feed_forward.W_{n}", "linear")
            for n in ("gate", "up", "down")
        ]
    rows = []
    for i, kind in enumerate(a["mixers"]):
        own = (
            _attention_rows(a, architecture)
            if kind == "attention"
            else _mixer_rows(a, architecture)
        )
        rows += per_layer(a["depth"], own + shared, a.get("n_experts") or 0, only=(i,))
    final = "model.embedding_norm.weight" if lfm2 else "model.norm.weight"
    return [
        *per_layer(1, [("model.embed_tokens.weight", "embed.table", "plain")]),
        *rows,
        *per_layer(1, [(final, "norm.gain", "plain")]),
    ]


def config(a: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The `config.json` keys that say `a` for `architecture` (read back by `arguments`)."""
    inverse = {mixer: kind for kind, mixer in KINDS[architecture].items()}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": a.get("rope_base", 1e4)}
    if a.get("rotary_fraction", 1.0) != 1.0:
        rope["partial_rotary_factor"] = a["rotary_fraction"]
    rope.update(dict(a.get("rope_scaling") or {}))
    out: dict[str, Any] = {
        "vocab_size": a["vocab"], "hidden_size": a["d_model"],
        "num_hidden_layers": a["depth"], "num_attention_heads": a["n_heads"],
        "num_key_value_heads": a.get("n_kv_heads") or a["n_heads"],
        "max_position_embeddings": a["max_len"], "tie_word_embeddings": a.get("tie_embeddings"),
        "rope_parameters": rope, "hidden_act": "silu",
        "layer_types": [inverse.get(m, "?") for m in a.get("mixers") or ["attention"] * a["depth"]],
    }  # fmt: skip
    options = dict(a.get("mixer_options") or {})
    if architecture == LFM2:
        conv = dict(options.get("short_conv") or {})
        out.update(
            intermediate_size=a["d_ff"], block_auto_adjust_ff_dim=False, norm_eps=a.get("eps"),
            conv_L_cache=conv.get("kernel", 3), conv_bias=conv.get("use_bias", False),
        )  # fmt: skip
        return out
    delta = dict(options.get("gated_deltanet") or {})
    d_head = a["d_model"] // delta.get("n_heads", 1) if delta else 128
    if architecture == QWEN35_MOE:
        out.update(
            moe_intermediate_size=a["d_ff"], num_experts=a.get("n_experts"),
            num_experts_per_tok=a.get("top_k"), norm_topk_prob=a.get("normalize_top_k", True),
            shared_expert_intermediate_size=a.get("shared_d_ff"),
        )  # fmt: skip
    else:
        out["intermediate_size"] = a["d_ff"]
    out.update(
        rms_norm_eps=a.get("eps"),
        head_dim=a.get("head_dim") or a["d_model"] // a["n_heads"],
        linear_num_value_heads=delta.get("n_heads", 32),
        linear_num_key_heads=delta.get("n_key_heads", delta.get("n_heads", 16)),
        linear_key_head_dim=delta.get("key_dim", d_head),
        linear_value_head_dim=delta.get("value_dim", d_head),
        linear_conv_kernel_dim=delta.get("kernel", 4),
    )  # fmt: skip
    if not math.isclose(float(delta.get("eps", a.get("eps", 1e-6))), float(a.get("eps", 1e-6))):
        raise HuggingFaceError(
            "Qwen3.5's Gated DeltaNet norms share `rms_norm_eps` with the others."
        )
    return out
