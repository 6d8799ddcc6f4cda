"""Import a Hugging Face causal language model directory into a `TransformerLM`, without torch or
transformers: `config.json` and `model.safetensors` (or the shards named by
`model.safetensors.index.json`), for GPT-2 (`GPT2LMHeadModel`), Llama (`LlamaForCausalLM`) and
Qwen2 (`Qwen2ForCausalLM`).

Every tensor of the checkpoint is used and every weight of the model filled, each shape checked
and every value finite; an architecture or a config option the model does not implement (rope
scaling, attention scaled by the layer index, a sliding window, ...) is named and refused, never
ignored. Errors are `HuggingFaceError`, naming the file and the tensor or option.
"""

import json
import math
import os
import pathlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from .nn.models.language_model import TransformerLM

__all__ = ["ARCHITECTURES", "HuggingFaceError", "import_hf", "load_tokenizer"]


class HuggingFaceError(ValueError):
    """A Hugging Face model directory that cannot be imported as it is."""


ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM")
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def import_hf(directory: str | os.PathLike[str]) -> tuple[TransformerLM, dict[str, Any]]:
    """The model of a Hugging Face directory, and the arguments it was built with (JSON values:
    `TransformerLM(**arguments, key=...)` builds its like).

    The logits are those of transformers' model to float32 round-off.
    """
    root = pathlib.Path(directory)
    config = _read_config(root)
    architecture = _architecture(root, config)
    arguments = (_gpt2_arguments if architecture == "GPT2LMHeadModel" else _llama_arguments)(
        config, architecture
    )
    tensors = _read_tensors(root)
    model = TransformerLM(**arguments, key=jax.random.PRNGKey(0))
    fill = _gpt2_weights if architecture == "GPT2LMHeadModel" else _llama_weights
    model = fill(model, _Tensors(root, tensors), arguments)
    return model, arguments


def _read_config(root: pathlib.Path) -> dict[str, Any]:
    path = root / "config.json"
    if not root.is_dir():
        raise HuggingFaceError(f"{root} is not a directory (a Hugging Face model directory).")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise HuggingFaceError(f"{path} is missing: a model directory holds its config.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HuggingFaceError(f"{path} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise HuggingFaceError(f"{path} holds a {type(config).__name__}, not a JSON object.")
    return config


def _architecture(root: pathlib.Path, config: dict[str, Any]) -> str:
    found = config.get("architectures")
    if not isinstance(found, list) or len(found) != 1 or found[0] not in ARCHITECTURES:
        raise HuggingFaceError(
            f"{root / 'config.json'}: `architectures` is {found!r}; this importer reads one of "
            f"{ARCHITECTURES}."
        )
    return str(found[0])


def _option(config: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = config.get(name, default)
    if value is None and default is None:
        return None
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise HuggingFaceError(f"config.json: `{name}` is {value!r}; expected a {kind}.")
    return value


def _refuse(config: dict[str, Any], name: str, allowed: Callable[[Any], bool], what: str) -> None:
    if name in config and not allowed(config[name]):
        raise HuggingFaceError(
            f"config.json: `{name}={config[name]!r}` ({what}) is not implemented by TransformerLM; "
            "refusing rather than ignoring it."
        )


def _gpt2_arguments(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    _refuse(
        config, "scale_attn_by_inverse_layer_idx", lambda v: not v, "attention scaled by 1/layer"
    )
    _refuse(config, "scale_attn_weights", bool, "attention without the 1/sqrt(d_head) scale")
    _refuse(config, "reorder_and_upcast_attn", lambda v: not v, "reordered attention")
    _refuse(config, "add_cross_attention", lambda v: not v, "cross-attention")
    _refuse(config, "activation_function", GPT2_ACTIVATIONS.__contains__, "the MLP's activation")
    d_model = _option(config, "n_embd", int, 768)
    return {
        "vocab": _option(config, "vocab_size", int, 50257),
        "d_model": d_model,
        "n_heads": _option(config, "n_head", int, 12),
        "d_ff": _option(config, "n_inner", int, None) or 4 * d_model,
        "depth": _option(config, "n_layer", int, 12),
        "max_len": _option(config, "n_positions", int, 1024),
        "positions": "learned",
        "norm": "layer",
        "feed_forward": "mlp",
        "activation": GPT2_ACTIVATIONS[config.get("activation_function", "gelu_new")],
        "eps": float(_option(config, "layer_norm_epsilon", (int, float), 1e-5)),
        "tie_embeddings": _option(config, "tie_word_embeddings", bool, True),
        "use_bias": True,
    }


def _rope_theta(config: dict[str, Any]) -> float:
    """The rotary base, from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (earlier): any rope type but the default is refused."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for where, values in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        if not isinstance(values, dict):
            raise HuggingFaceError(f"config.json: `{where}` is {values!r}; expected an object.")
        kind = values.get("rope_type", values.get("type", "default"))
        if kind != "default":
            raise HuggingFaceError(
                f"config.json: `{where}` asks for rope type {kind!r} (scaled rotary positions), "
                "which TransformerLM does not implement; refusing rather than ignoring it."
            )
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta):
        raise HuggingFaceError(f"config.json: `rope_theta` is {theta!r}; expected a number.")
    return float(theta)


def _llama_arguments(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    _refuse(config, "hidden_act", lambda v: v == "silu", "the gated MLP's activation")
    _refuse(config, "mlp_bias", lambda v: not v, "biases in the MLP")
    _refuse(config, "use_sliding_window", lambda v: not v, "sliding-window layers")
    d_model = _option(config, "hidden_size", int, 4096)
    n_heads = _option(config, "num_attention_heads", int, 32)
    _refuse(config, "head_dim", lambda v: v in (None, d_model // n_heads), "a head width apart")
    qwen = architecture == "Qwen2ForCausalLM"
    _refuse(config, "attention_bias", lambda v: not v or not qwen, "output projection bias")
    return {
        "vocab": _option(config, "vocab_size", int, 32000),
        "d_model": d_model,
        "n_heads": n_heads,
        "d_ff": _option(config, "intermediate_size", int, 11008),
        "depth": _option(config, "num_hidden_layers", int, 32),
        "max_len": _option(config, "max_position_embeddings", int, 2048),
        "positions": "rope",
        "rope_base": _rope_theta(config),
        "norm": "rms",
        "feed_forward": "gated",
        "activation": "silu",
        "eps": float(_option(config, "rms_norm_eps", (int, float), 1e-6)),
        "tie_embeddings": _option(config, "tie_word_embeddings", bool, False),
        "n_kv_heads": _option(config, "num_key_value_heads", int, None) or n_heads,
        "use_bias": qwen or bool(config.get("attention_bias", False)),
    }


def _read_tensors(root: pathlib.Path) -> dict[str, tuple[np.ndarray, pathlib.Path]]:
    """Every tensor of the directory's safetensors files, with the file it came from."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({root / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise HuggingFaceError(f"{index}: not a readable shard index ({error!r}).") from None
    else:
        files = [root / "model.safetensors"]
    tensors: dict[str, tuple[np.ndarray, pathlib.Path]] = {}
    for path in files:
        if not path.is_file():
            raise HuggingFaceError(f"{path} is missing.")
        try:
            loaded = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as error:
            raise HuggingFaceError(f"{path} is not a readable safetensors file: {error}") from None
        for name, array in loaded.items():
            if name in tensors:
                raise HuggingFaceError(f"{path}: tensor {name!r} is also in {tensors[name][1]}.")
            tensors[name] = (array, path)
    if index.exists():
        listed = set(weight_map)
        if listed != set(tensors):
            raise HuggingFaceError(
                f"{index} lists other tensors than the shards hold: "
                f"{sorted(listed ^ set(tensors))[:5]}."
            )
    return tensors


class _Tensors:
    """The checkpoint's tensors, taken one by one (shape and finiteness checked); `done` refuses
    any left unused."""

    def __init__(self, root: pathlib.Path, tensors: dict[str, tuple[np.ndarray, pathlib.Path]]):
        self.root, self.tensors, self.used = root, tensors, set[str]()

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise HuggingFaceError(f"{self.root}: the checkpoint has no tensor {name!r}.")
        array, path = self.tensors[name]
        if array.shape != shape:
            raise HuggingFaceError(
                f"{path}: tensor {name!r} has shape {array.shape}; the config asks for {shape}."
            )
        if not np.issubdtype(array.dtype, np.floating) and array.dtype.kind != "V":
            raise HuggingFaceError(f"{path}: tensor {name!r} is {array.dtype}, not floating point.")
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise HuggingFaceError(f"{path}: tensor {name!r} holds non-finite values.")
        self.used.add(name)
        return array

    def done(self) -> None:
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            raise HuggingFaceError(
                f"{self.root}: {len(unused)} tensors of the checkpoint have no place in the model "
                f"(first: {unused[:3]}); refusing rather than dropping them."
            )


def _set(model: TransformerLM, where: Callable[[Any], Any], value: np.ndarray) -> TransformerLM:
    return eqx.tree_at(where, model, jnp.asarray(value, jnp.float32))


def _blocks(model: TransformerLM) -> tuple[Any, ...]:
    assert isinstance(model.blocks, tuple)  # built unstacked (scan_layers=False)
    return model.blocks


def _gpt2_weights(model: TransformerLM, t: _Tensors, a: dict[str, Any]) -> TransformerLM:
    d, ff, vocab = a["d_model"], a["d_ff"], a["vocab"]
    model = _set(model, lambda m: m.embed.table.value, t.take("transformer.wte.weight", (vocab, d)))
    model = _set(
        model, lambda m: m.positions.P.value, t.take("transformer.wpe.weight", (a["max_len"], d))
    )
    for i in range(a["depth"]):
        p = f"transformer.h.{i}."
        qkv = t.take(p + "attn.c_attn.weight", (d, 3 * d))  # Conv1D: (in, out)
        qkv_bias = t.take(p + "attn.c_attn.bias", (3 * d,))
        weights = {
            "attention.W_Q": qkv[:, :d], "attention.W_K": qkv[:, d : 2 * d],
            "attention.W_V": qkv[:, 2 * d :], "attention.b_Q": qkv_bias[:d],
            "attention.b_K": qkv_bias[d : 2 * d], "attention.b_V": qkv_bias[2 * d :],
            "attention.W_O": t.take(p + "attn.c_proj.weight", (d, d)),
            "attention.b_O": t.take(p + "attn.c_proj.bias", (d,)),
            "norm1.gain": t.take(p + "ln_1.weight", (d,)),
            "norm1.bias": t.take(p + "ln_1.bias", (d,)),
            "norm2.gain": t.take(p + "ln_2.weight", (d,)),
            "norm2.bias": t.take(p + "ln_2.bias", (d,)),
            "feed_forward.hidden.W": t.take(p + "mlp.c_fc.weight", (d, ff)),
            "feed_forward.hidden.b": t.take(p + "mlp.c_fc.bias", (ff,)),
            "feed_forward.out.W": t.take(p + "mlp.c_proj.weight", (ff, d)),
            "feed_forward.out.b": t.take(p + "mlp.c_proj.bias", (d,)),
        }  # fmt: skip
        model = _fill_block(model, i, weights)
    model = _set(model, lambda m: m.norm.gain.value, t.take("transformer.ln_f.weight", (d,)))
    model = _set(model, lambda m: m.norm.bias.value, t.take("transformer.ln_f.bias", (d,)))
    model = _head(model, t, a, "lm_head.weight")
    t.done()
    return model


def _llama_weights(model: TransformerLM, t: _Tensors, a: dict[str, Any]) -> TransformerLM:
    d, ff, vocab = a["d_model"], a["d_ff"], a["vocab"]
    kv = d // a["n_heads"] * a["n_kv_heads"]
    model = _set(
        model, lambda m: m.embed.table.value, t.take("model.embed_tokens.weight", (vocab, d))
    )
    for i in range(a["depth"]):
        p = f"model.layers.{i}."
        weights = {
            # torch's Linear holds (out, in): transposed to dense_armor's (in, out)
            "attention.W_Q": t.take(p + "self_attn.q_proj.weight", (d, d)).T,
            "attention.W_K": t.take(p + "self_attn.k_proj.weight", (kv, d)).T,
            "attention.W_V": t.take(p + "self_attn.v_proj.weight", (kv, d)).T,
            "attention.W_O": t.take(p + "self_attn.o_proj.weight", (d, d)).T,
            "norm1.gain": t.take(p + "input_layernorm.weight", (d,)),
            "norm2.gain": t.take(p + "post_attention_layernorm.weight", (d,)),
            "feed_forward.W_gate": t.take(p + "mlp.gate_proj.weight", (ff, d)).T,
            "feed_forward.W_up": t.take(p + "mlp.up_proj.weight", (ff, d)).T,
            "feed_forward.W_down": t.take(p + "mlp.down_proj.weight", (d, ff)).T,
        }
        if a["use_bias"]:
            weights["attention.b_Q"] = t.take(p + "self_attn.q_proj.bias", (d,))
            weights["attention.b_K"] = t.take(p + "self_attn.k_proj.bias", (kv,))
            weights["attention.b_V"] = t.take(p + "self_attn.v_proj.bias", (kv,))
            o_bias = p + "self_attn.o_proj.bias"  # Llama's attention_bias; Qwen2 has none
            weights["attention.b_O"] = t.take(o_bias, (d,)) if o_bias in t.tensors else np.zeros(d)
        model = _fill_block(model, i, weights)
    model = _set(model, lambda m: m.norm.gain.value, t.take("model.norm.weight", (d,)))
    model = _head(model, t, a, "lm_head.weight")
    t.done()
    return model


def _head(model: TransformerLM, t: _Tensors, a: dict[str, Any], name: str) -> TransformerLM:
    """The untied head's matrix; a tied model may store a copy of the table, which must equal
    it."""
    shape = (a["vocab"], a["d_model"])
    if model.head is not None:
        return _set(model, lambda m: m.head.W.value, t.take(name, shape).T)
    stored = t.take(name, shape) if name in t.tensors else None  # a tied checkpoint's copy
    if stored is not None and not np.array_equal(stored, np.asarray(model.embed.table.value)):
        raise HuggingFaceError(
            f"{t.root}: `tie_word_embeddings` is true but {name!r} differs from the "
            "embedding table."
        )
    return model


def _fill_block(model: TransformerLM, i: int, weights: dict[str, np.ndarray]) -> TransformerLM:
    for path, value in weights.items():

        def where(m: TransformerLM, path: str = path) -> Any:
            node: Any = _blocks(m)[i]
            for part in path.split("."):
                node = getattr(node, part)
            return node.value

        model = _set(model, where, value)
    return model


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The `tokenizers.Tokenizer` of a `tokenizer.json` (or of a directory holding one), for text
    in and out of a language model: `encode(text).ids`, `decode(ids)`. Needs the `tokenizers`
    library (`pip install 'dense-armor[text]'`)."""
    file = pathlib.Path(path)
    file = file / "tokenizer.json" if file.is_dir() else file
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise HuggingFaceError(
            "reading a tokenizer needs the `tokenizers` library: pip install 'dense-armor[text]'."
        ) from None
    if not file.is_file():
        raise HuggingFaceError(f"{file} is missing: no tokenizer to read.")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # the library raises its own exception type
        raise HuggingFaceError(f"{file} is not a readable tokenizer.json: {error}") from None
