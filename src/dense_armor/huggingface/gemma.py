"""The Gemma family: Gemma (`GemmaForCausalLM`), Gemma 2 and Gemma 3's text model. Gemma's
conventions are options of the one model: the embedding scaled by `sqrt(hidden)`, RMSNorm scaled
by `1 + w`, the tanh GeGLU, a tied head; Gemma 2 and 3 add four norms per block, a query scale of
`query_pre_attn_scalar ** -0.5`, sliding and global layers (each kind its own rotary base in
Gemma 3), soft-capped scores and logits (Gemma 2) and per-head query/key norms (Gemma 3).

The hub's Gemma 2 and 3 files were written by transformers 4 and carry no `layer_types`: the
layers' kinds are then derived as transformers derives them (Gemma 2: every second layer global;
Gemma 3: every `sliding_window_pattern`-th, 6 when absent), and Gemma 3's rotary bases from
`rope_theta` (the global layers', 1e6 when absent, with `rope_scaling`) and `rope_local_base_freq`
(the sliding layers', 1e4 when absent)."""

from typing import Any

from ._files import HuggingFaceError, option, refuse
from ._keys import with_changes
from ._tables import Table, per_layer
from .llama import layer_windows, per_layer_options
from .rope import LAYER_TYPES

__all__ = ["ARCHITECTURES", "DEFAULTS", "IGNORED", "arguments", "table"]

ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GEMMA = {
    "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
    "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "attention_bias": False, "rope_theta": 10000.0,
}  # fmt: skip
_LATER = {**_GEMMA, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
          "num_attention_heads": 8, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
          "sliding_window": 4096}  # fmt: skip
# transformers 5's defaults of each architecture's config class: what a key left out of a
# config means (the hub's files leave many out). Applied under the config before it is read.
DEFAULTS = {
    "GemmaForCausalLM": _GEMMA,
    "Gemma2ForCausalLM": {**_LATER, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {**_LATER, "vocab_size": 262208, "max_position_embeddings": 131072,
                          "rope_theta": 1e6},  # the global layers' (the sliding ones': 1e4)
}  # fmt: skip
# Keys the hub's files carry that transformers' Gemma 2 and 3 do not read (their MLP reads
# `hidden_activation`)
IGNORED = {"Gemma2ForCausalLM": ("hidden_act",), "Gemma3ForCausalLM": ("hidden_act",)}
_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _activation(config: dict[str, Any], architecture: str) -> str:
    """The GeGLU's activation: the tanh GELU. Gemma reads `hidden_act` (its `"gelu"` meant the
    tanh form, as transformers says), and transformers 4's files may carry `hidden_activation`
    beside it; Gemma 2 and 3 read `hidden_activation` (the tanh GELU when absent)."""
    names = {"hidden_activation": config.get("hidden_activation") or "gelu_pytorch_tanh"}
    if architecture == "GemmaForCausalLM":
        names["hidden_act"] = config.get("hidden_act") or "gelu_pytorch_tanh"
    for key, name in names.items():
        allowed = (*_TANH, "gelu") if key == "hidden_act" else _TANH
        refuse({key: name}, key, allowed.__contains__, "the GeGLU's activation")
    return "gelu_tanh"


def _layer_types(config: dict[str, Any], architecture: str, depth: int) -> list[str]:
    """Gemma 2 and 3's layer kinds: `layer_types`, or the pattern transformers derives for
    files without it (see the module)."""
    types = config.get("layer_types")
    pattern = option(config, "sliding_window_pattern", int, 6)
    saved = config.get("_sliding_window_pattern")  # transformers 5 writes its own copy
    if types is not None:
        return list(types) if isinstance(types, list) else types
    if saved is not None and "sliding_window_pattern" in config and saved != pattern:
        raise HuggingFaceError(
            f"config.json: `sliding_window_pattern` {pattern} and `_sliding_window_pattern` "
            f"{saved!r} disagree, and no `layer_types` says which layers slide."
        )
    if architecture == "Gemma2ForCausalLM":
        pattern = 2
    elif saved is not None and "sliding_window_pattern" not in config:
        pattern = option({"_sliding_window_pattern": saved}, "_sliding_window_pattern", int, 6)
    if pattern < 1:
        raise HuggingFaceError(f"config.json: `sliding_window_pattern` is {pattern}.")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(depth)]


def _gemma3_rope(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's rotary options per layer kind in transformers 5's nested `rope_parameters`,
    from the older keys when the file has them (see the module)."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and any(kind in parameters for kind in LAYER_TYPES):
        return parameters
    if parameters is not None:
        raise HuggingFaceError(
            f"config.json: a Gemma 3 `rope_parameters` holds one mapping per layer kind "
            f"{LAYER_TYPES}; found {parameters!r}."
        )
    scaling = config.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise HuggingFaceError(f"config.json: `rope_scaling` is {scaling!r}; expected an object.")
    full = {"rope_type": "default", **scaling}
    full.setdefault("rope_theta", config.get("rope_theta"))  # DEFAULTS: 1e6
    local = config.get("rope_local_base_freq", 1e4)
    return {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }


def _later(config: dict[str, Any], architecture: str, depth: int) -> dict[str, Any]:
    """Gemma 2 and 3's config in transformers 5's terms: `layer_types` always, and Gemma 3's
    rotary options nested by layer kind."""
    changes: dict[str, Any] = {"layer_types": _layer_types(config, architecture, depth)}
    if architecture == "Gemma3ForCausalLM":
        changes["rope_parameters"] = _gemma3_rope(config)
    return with_changes(config, **changes)


def arguments(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`TransformerLM`'s arguments for the config (options it does not build refused by name)."""
    refuse(config, "use_bidirectional_attention", lambda v: not v, "bidirectional attention")
    refuse(config, "attention_bias", lambda v: not v, "biases on the projections")
    d_model = option(config, "hidden_size", int, 2048)
    n_heads = option(config, "num_attention_heads", int, 8)
    depth = option(config, "num_hidden_layers", int, 18)
    eps = float(option(config, "rms_norm_eps", (int, float), 1e-6))
    later = architecture != "GemmaForCausalLM"
    if later:
        config = _later(config, architecture, depth)
    windows = layer_windows(config, depth) if later else [None] * depth
    shared, layers = per_layer_options(config, depth, windows, 1e4)  # bases from DEFAULTS
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
        "activation": _activation(config, architecture),
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
