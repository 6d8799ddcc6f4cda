"""Hugging Face causal language models in and out of a `TransformerLM`, without torch or
transformers: `import_hf` reads a model directory (`config.json` and `model.safetensors`, or the
shards `model.safetensors.index.json` names), `export_hf` writes one that transformers loads.

Each architecture family is a module with its config's reading (`arguments`) and a declared table
of its tensor names (`table`, see `_tables`): GPT-2 (`gpt2`), the Llama lineage (`llama`: Llama
2/3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3/4-mini, OLMo 2, StarCoder2) and Gemma (`gemma`: Gemma 1, 2
and 3's text model), the hybrids (`hybrid`: LFM2, Qwen3.5 and its mixture of experts). A
multimodal checkpoint whose text model is one of these (`WRAPPERS`: Qwen3.5's) is read as that
text model. Every tensor of a checkpoint is used and every weight of the model filled,
each shape checked and every value finite; an architecture or a config option the model does not
implement (`longrope` and `dynamic` rope scaling, attention scaled by the layer index, ...) is
named and refused, never ignored; the only tensors not read are those transformers does not read
into the text model either (`UNREAD`: a wrapper's vision tower, Qwen3.5's multi-token
prediction layers). Errors are `HuggingFaceError`, naming the file and the tensor or
option.
"""

import os
import pathlib
from types import ModuleType
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..nn import precision
from ..nn.models.language_model import TransformerLM
from . import gemma, gpt2, hybrid, llama
from ._files import HuggingFaceError, Tensors, load_tokenizer, read_config, read_tensors
from ._keys import read_arguments
from ._tables import Entry, Table, fill
from .writing import export_hf

__all__ = [
    "ARCHITECTURES", "WRAPPERS", "HuggingFaceError", "export_hf", "import_hf", "load_tokenizer",
    "text_model",
]  # fmt: skip

FAMILIES: dict[str, ModuleType] = {
    name: family for family in (gpt2, llama, gemma, hybrid) for name in family.ARCHITECTURES
}
ARCHITECTURES = tuple(FAMILIES)
# Multimodal checkpoints read as their text model: the wrapper's architecture, the text model's
# (its config the wrapper's `text_config`), and where the text model's tensors are (read as
# `model.`).
WRAPPERS = {
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "model.language_model."),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "model.language_model."),
}
# The tensors a checkpoint carries that transformers does not read into the text model either
# (its `_keys_to_ignore_on_load_unexpected`), by the prefix of their names.
UNREAD = {
    "Qwen3_5ForCausalLM": ("mtp.",),
    "Qwen3_5MoeForCausalLM": ("mtp.",),
    "Qwen3_5ForConditionalGeneration": ("mtp.", "model.visual."),
    "Qwen3_5MoeForConditionalGeneration": ("mtp.", "model.visual."),
}


def import_hf(
    directory: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    quantize: str | None = None,
    quantize_embeddings: bool = False,
) -> tuple[TransformerLM, dict[str, Any]]:
    """The model of a Hugging Face directory, and the arguments it was built with (JSON values:
    `TransformerLM(**arguments, key=...)` builds its like).

    `dtype`: the weights' dtype (`"float32"`, `"bfloat16"`, `"float16"`; a bfloat16 checkpoint
    read as bfloat16 is kept as stored, never widened in between); `quantize="int8"` (and
    `quantize_embeddings`): the projections as int8, one matrix at a time as it is read (see
    `dense_armor.nn.precision`). Both are recorded in the arguments.

    In float32 the logits are those of transformers' model to float32 round-off. The weights are
    read one tensor at a time into a model built without arrays of its own, so importing holds
    about one copy of them (in `dtype`).
    """
    root = pathlib.Path(directory)
    config = read_config(root)
    wrapper = architecture_of(root, config)
    architecture, config = text_model(config, root)
    arguments = read_arguments(FAMILIES[architecture], config, architecture)
    wanted = {
        "param_dtype": dtype,
        "quantize": quantize,
        "quantize_embeddings": quantize_embeddings,
    }
    _skeleton({**arguments, **wanted})  # the options checked, by the model's own rules
    # filled in our (n_in, n_out) layout and `dtype`, then held as the options say
    skeleton = jax.tree.map(lambda leaf: _as(leaf, dtype), _skeleton(arguments))
    tensors = Tensors(root, _text_tensors(read_tensors(root), wrapper), dtype)
    model = fill(skeleton, full_table(arguments, architecture), tensors.take)
    _check_tied_copy(model, tensors, arguments)
    tensors.done()
    if quantize is not None:
        model = precision.quantize(model, quantize_embeddings)
    model = precision.cast(model, dtype)
    arguments.update({k: v for k, v in wanted.items() if v not in ("float32", None, False)})
    return model, arguments


def _as(leaf: Any, dtype: str) -> Any:
    """An abstract floating array of the skeleton in `dtype`."""
    if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
        return jax.ShapeDtypeStruct(leaf.shape, dtype)
    return leaf


def architecture_of(root: pathlib.Path, config: dict[str, Any]) -> str:
    found = config.get("architectures")
    known = (*ARCHITECTURES, *WRAPPERS)
    if not isinstance(found, list) or len(found) != 1 or found[0] not in known:
        raise HuggingFaceError(
            f"{root / 'config.json'}: `architectures` is {found!r}; this importer reads one of "
            f"{known}."
        )
    return str(found[0])


def text_model(
    config: dict[str, Any], root: pathlib.Path = pathlib.Path(".")
) -> tuple[str, dict[str, Any]]:
    """The text model's architecture and config of a checkpoint's config: its own, or a
    wrapper's `text_config` (with the wrapper's `tie_word_embeddings`, which transformers
    reads)."""
    architecture = architecture_of(root, config)
    if architecture not in WRAPPERS:
        return architecture, config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise HuggingFaceError(
            f"{root / 'config.json'}: a {architecture} config holds its text model's as "
            f"`text_config`, an object; found {text!r}."
        )
    tied = {"tie_word_embeddings": config["tie_word_embeddings"]}
    return WRAPPERS[architecture][0], {**text, **(tied if "tie_word_embeddings" in config else {})}


class _Renamed:
    """A safetensors file's tensor read under another name."""

    def __init__(self, handle: Any, name: str):
        self.handle, self.name = handle, name

    def get_tensor(self, _: str) -> Any:
        return self.handle.get_tensor(self.name)


def _text_tensors(
    tensors: dict[str, tuple[Any, pathlib.Path]], architecture: str
) -> dict[str, tuple[Any, pathlib.Path]]:
    """The checkpoint's tensors that the text model reads, by the text model's names."""
    unread = UNREAD.get(architecture, ())
    prefix = WRAPPERS[architecture][1] if architecture in WRAPPERS else None
    out = {}
    for name, (handle, path) in tensors.items():
        if name.startswith(unread):
            continue
        if prefix is not None and name.startswith(prefix):
            out["model." + name[len(prefix) :]] = (_Renamed(handle, name), path)
        else:
            out[name] = (handle, path)
    return out


def full_table(arguments: dict[str, Any], architecture: str) -> Table:
    """The family's table, and the head's matrix when it is not the embedding's."""
    table = FAMILIES[architecture].table(arguments, architecture)
    if not arguments["tie_embeddings"]:
        table.append(Entry("lm_head.weight", ("head.W",), "linear"))
    return table


def _skeleton(arguments: dict[str, Any]) -> TransformerLM:
    """The model's structure and shapes, with no arrays (filled by the table)."""
    try:
        return eqx.filter_eval_shape(TransformerLM, **arguments, key=jax.random.PRNGKey(0))
    except (ValueError, TypeError) as error:
        raise HuggingFaceError(
            f"config.json describes no model TransformerLM builds: {error}"
        ) from None


def _check_tied_copy(model: TransformerLM, tensors: Tensors, arguments: dict[str, Any]) -> None:
    """A tied checkpoint may store a copy of the table as `lm_head.weight`, which must equal it."""
    if not arguments["tie_embeddings"] or "lm_head.weight" not in tensors.tensors:
        return
    stored = tensors.take("lm_head.weight", (arguments["vocab"], arguments["d_model"]))
    if stored is None or not np.array_equal(stored, np.asarray(model.embed.table.value)):
        raise HuggingFaceError(
            f"{tensors.root}: `tie_word_embeddings` is true but 'lm_head.weight' differs from the "
            "embedding table."
        )
