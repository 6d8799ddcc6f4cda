"""`export_hf`: a `TransformerLM` written back as a Hugging Face model directory (`config.json`,
`model.safetensors`, the tokenizer's files), by the same declared tables the importer reads, so
that a model trained or fine-tuned here goes back to the hub's tools.

The config is written from the model's arguments in transformers 5's spelling (`rope_parameters`,
`layer_types`), then read back by the importer: a model whose arguments the architecture cannot
say (a Qwen3 written as GPT-2, a window on a Llama) is refused naming the arguments that differ,
never written half right.
"""

import json
import os
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..checkpoints.atomic import write_directory
from ..checkpoints.tensors import write_safetensors
from ..nn.models.language_model import TransformerLM
from ..nn.models.sequential import Sequential
from ..nn.models.stack import Stack
from . import hybrid
from ._files import HuggingFaceError
from ._keys import read_arguments
from ._tables import gather

__all__ = ["TOKENIZER_FILES", "export_hf", "hf_config"]

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json",
)  # fmt: skip
# The source config's keys kept as they are (what the model's arguments do not say).
KEPT = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache")
# Arguments that change how a model runs here, not what it computes.
RUNTIME = ("scan_layers", "remat", "on_invalid", "implementation", "memory_efficient")
MODEL_TYPES = {
    "GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2", "Starcoder2ForCausalLM": "starcoder2",
    "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Lfm2ForCausalLM": "lfm2", "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
}  # fmt: skip
# The architectures whose transformers model reads no `sliding_window`
UNWINDOWED = ("LlamaForCausalLM", "Olmo2ForCausalLM", "GemmaForCausalLM")
ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def _rope(options: Mapping[str, Any]) -> dict[str, Any]:
    """`rope_parameters` for one kind of layer, from its attention options."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": options.get("rope_base", 1e4)}
    out.update(dict(options.get("rope_scaling") or {}))
    if options.get("rotary_fraction", 1.0) != 1.0:
        out["partial_rotary_factor"] = options["rotary_fraction"]
    return out


def _layers(a: Mapping[str, Any]) -> tuple[list[str], int | None, dict[str, Any]]:
    """`layer_types`, `sliding_window` and `rope_parameters` (nested by layer type when the
    kinds differ in their rotary positions)."""
    layers = [{**a, **layer} for layer in a.get("layer_options") or [{}] * a["depth"]]
    types = ["sliding_attention" if layer.get("window") else "full_attention" for layer in layers]
    windows = {layer["window"] for layer in layers if layer.get("window")}
    if len(windows) > 1:
        raise HuggingFaceError(f"the layers' windows differ ({sorted(windows)}): a config has one.")
    by_type = {kind: _rope(layer) for kind, layer in zip(types, layers, strict=True)}
    ropes = list(by_type.values())
    rope = ropes[0] if all(r == ropes[0] for r in ropes) else by_type
    return types, (windows.pop() if windows else None), rope


def hf_config(arguments: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The `config.json` that says `arguments` for `architecture`."""
    a = arguments
    if architecture in hybrid.ARCHITECTURES:
        return hybrid.config(a, architecture)
    if architecture == "GPT2LMHeadModel":
        gelu = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
        return {
            "n_embd": a["d_model"], "n_head": a["n_heads"], "n_inner": a["d_ff"],
            "n_layer": a["depth"], "n_positions": a["max_len"], "vocab_size": a["vocab"],
            "activation_function": gelu.get(a.get("activation", "gelu_tanh"), "?"),
            "layer_norm_epsilon": a.get("eps", 1e-5),
            "tie_word_embeddings": a.get("tie_embeddings", True),
        }  # fmt: skip
    types, window, rope = _layers(a)
    config: dict[str, Any] = {
        "vocab_size": a["vocab"], "hidden_size": a["d_model"], "intermediate_size": a["d_ff"],
        "num_hidden_layers": a["depth"], "num_attention_heads": a["n_heads"],
        "num_key_value_heads": a.get("n_kv_heads") or a["n_heads"],
        "head_dim": a.get("head_dim") or a["d_model"] // a["n_heads"],
        "max_position_embeddings": a["max_len"], "rms_norm_eps": a.get("eps", 1e-6),
        "tie_word_embeddings": a.get("tie_embeddings", True), "rope_parameters": rope,
        "hidden_act": ACTIVATION_NAMES.get(a.get("activation", "silu"), "?"),
        "attention_bias": bool(a.get("use_bias", False)),
    }  # fmt: skip
    if window is not None or architecture not in UNWINDOWED:
        config["sliding_window"] = window  # read by the others (a window on Llama: refused)
    if architecture != "MistralForCausalLM" and architecture != "Phi3ForCausalLM":
        config["layer_types"] = types
    if rope.get("rope_type") == "longrope":  # Phi-3's config reads its own key, default 4096
        config["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if architecture in ("Qwen2ForCausalLM", "Starcoder2ForCausalLM"):
        del config["attention_bias"]  # biases said by the architecture, or by `use_bias`
    config.update(_family_keys(a, architecture, window))
    return config


def _family_keys(a: Mapping[str, Any], architecture: str, window: int | None) -> dict[str, Any]:
    """The keys one architecture spells its own way."""
    if architecture == "GemmaForCausalLM":  # Gemma 1 reads `hidden_act`, written above
        return {}
    if architecture.startswith("Gemma"):
        scale = a.get("query_scale")
        scalar = a.get("head_dim", 256) if scale is None else round(scale**-2, 6)
        return {
            "hidden_activation": ACTIVATION_NAMES.get(str(a.get("activation")), "?"),
            "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
            "attn_logit_softcapping": a.get("logit_softcap"),
            "final_logit_softcapping": a.get("final_logit_softcap"),
        }
    if architecture == "MixtralForCausalLM":
        return {"num_local_experts": a.get("n_experts"), "num_experts_per_tok": a.get("top_k")}
    if architecture == "Qwen3MoeForCausalLM":
        return {
            "use_sliding_window": window is not None, "max_window_layers": a["depth"],
            "num_experts": a.get("n_experts"), "num_experts_per_tok": a.get("top_k"),
            "moe_intermediate_size": a["d_ff"], "norm_topk_prob": a.get("normalize_top_k", True),
            "decoder_sparse_step": 1, "mlp_only_layers": [],
        }  # fmt: skip
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return {"use_sliding_window": window is not None, "max_window_layers": a["depth"]}
    if architecture == "Starcoder2ForCausalLM":
        return {"norm_epsilon": a.get("eps", 1e-5), "use_bias": bool(a.get("use_bias"))}
    return {}


def _unrolled(model: TransformerLM) -> TransformerLM:
    """`model` with its blocks in a plain tuple (a scanned model's stacks unstacked)."""
    items = model.blocks if isinstance(model.blocks, tuple) else (model.blocks,)
    blocks: list[Any] = []
    for item in items:
        for layer in item.unstack() if isinstance(item, Stack) else (item,):
            blocks.extend(layer.layers if isinstance(layer, Sequential) else (layer,))
    return eqx.tree_at(lambda m: m.blocks, model, tuple(blocks))


def _defaults() -> dict[str, Any]:
    """`TransformerLM`'s keyword defaults and its attention's."""
    import inspect

    from ..nn.mixers.self_attention import MultiHeadSelfAttention

    out = {}
    for built in (MultiHeadSelfAttention, TransformerLM):
        for name, parameter in inspect.signature(built).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                out[name] = parameter.default
    return out


def _comparable(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """`arguments` with every default said and each layer's attention options in full, so that
    two spellings of one model compare equal."""
    from ..nn.kernels.rotary import check_rope_scaling
    from ..nn.mixers.options import ATTENTION_OPTIONS

    full = {**_defaults(), **arguments}
    full["head_dim"] = full.get("head_dim") or full["d_model"] // full["n_heads"]
    full["n_kv_heads"] = full.get("n_kv_heads") or full["n_heads"]
    shared = {k: full.pop(k) for k in ATTENTION_OPTIONS if k in full}
    layers = [{**shared, **layer} for layer in full.pop("layer_options") or [{}] * full["depth"]]
    for layer in layers:
        layer["rope_scaling"] = check_rope_scaling(layer.get("rope_scaling"))
    full["layers"] = layers
    for name in (*RUNTIME, "causal", "key"):
        full.pop(name, None)
    return full


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return [
            d
            for k in sorted(set(a) | set(b))
            for d in _differences(a.get(k), b.get(k), f"{where}.{k}")
        ]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{where}[{i}]")]
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
        return (
            [] if np.isclose(a, b, rtol=1e-9, atol=0) else [f"{where.lstrip('.')}: {a!r} != {b!r}"]
        )
    return [] if a == b else [f"{where.lstrip('.')}: {a!r} != {b!r}"]


# a model's precision, which the weights' dtype says (a Hugging Face config only its `dtype`)
PRECISION = ("param_dtype", "compute_dtype", "quantize", "quantize_embeddings")


def _check_writable(model: Any, architecture: Any) -> None:
    """`export_hf`'s model and architecture: a `TransformerLM`, a text model's architecture."""
    from . import FAMILIES, WRAPPERS

    if isinstance(architecture, str) and architecture in WRAPPERS:
        raise HuggingFaceError(
            f"a {architecture} holds another modality's model beside the text model; export_hf "
            f"writes the text model: pass `architecture={WRAPPERS[architecture][0]!r}`."
        )
    if not isinstance(architecture, str) or architecture not in FAMILIES:
        raise HuggingFaceError(
            f"`architecture` must be one of {tuple(FAMILIES)}; received {architecture!r}."
        )
    if not isinstance(model, TransformerLM):
        raise HuggingFaceError(
            f"export_hf writes a TransformerLM; received {type(model).__name__}."
        )


def _read_back(
    config: dict[str, Any], arguments: Mapping[str, Any], architecture: str
) -> dict[str, Any]:
    """The arguments the importer reads from `config`, refused unless they are the model's own:
    a config that cannot say the model is never written."""
    from . import FAMILIES

    try:
        read_back = read_arguments(
            FAMILIES[architecture], json.loads(json.dumps(config)), architecture
        )
    except HuggingFaceError as error:
        raise HuggingFaceError(
            f"a {architecture} config cannot say this model's arguments: {error}"
        ) from None
    differences = _differences(_comparable(arguments), _comparable(read_back))
    if differences:
        raise HuggingFaceError(
            f"a {architecture} config cannot say this model's arguments: {differences[:4]}."
        )
    return read_back


def export_hf(
    model: TransformerLM,
    arguments: Mapping[str, Any],
    directory: str | os.PathLike[str],
    *,
    architecture: str,
    source: Mapping[str, Any] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
) -> pathlib.Path:
    """Write `model` (built from `arguments`) as a Hugging Face directory of `architecture`
    (one of `ARCHITECTURES`), atomically: `config.json` (with `source`'s token ids and other
    keys the arguments do not say, when given: the imported directory's config), the weights in
    the model's `param_dtype` (float32 by default; int8 weights dequantized into it, as a
    Hugging Face checkpoint holds no int8 of ours) as `model.safetensors`, and the tokenizer
    files of the directory `tokenizer` (those of `TOKENIZER_FILES` it has). Returns the
    directory."""
    from . import full_table

    _check_writable(model, architecture)
    dtype = str(arguments.get("param_dtype") or "float32")
    arguments = {k: v for k, v in arguments.items() if k not in PRECISION}
    config = {k: source[k] for k in KEPT if source and k in source}
    config.update(hf_config(arguments, architecture))
    config.update(architectures=[architecture], model_type=MODEL_TYPES[architecture], dtype=dtype)
    read_back = _read_back(config, arguments, architecture)
    tensors = gather(_unrolled(model), full_table(read_back, architecture))
    tensors = {name: t.astype(jnp.dtype(dtype), copy=False) for name, t in tensors.items()}

    def fill(tmp: pathlib.Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        for name in TOKENIZER_FILES if tokenizer is not None else ():
            path = pathlib.Path(tokenizer) / name  # type: ignore[arg-type]
            if path.is_file():
                shutil.copyfile(path, tmp / name)

    return write_directory(pathlib.Path(directory), fill)
