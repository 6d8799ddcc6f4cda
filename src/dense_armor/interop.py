"""Import a PyTorch Transformer into the equivalent dense_armor model, without PyTorch.

`import_torch(state, config)` reads the state dict of a `torch.nn.TransformerEncoder` (or
`TransformerDecoder`) stack and of the `Linear` layers around it, as safetensors or as a mapping
of NumPy arrays, into the model that `config` builds (`transformer_encoder` or
`transformer_decoder`, built with the same options: `use_bias=True` for PyTorch's attention
biases, `activation`, `layer_norm_eps`, `norm_first`; a decoder's `d_context` equal to
`d_model`, as PyTorch's cross-attention takes it). `dense-armor import-torch` does it from a
shell and writes a checkpoint that `dense-armor export` takes.

The names, by PyTorch's conventions: the stack's layers `<prefix>layers.<i>.` (found by
themselves), a pre-LN stack's final `<prefix>norm`, and the input and output `Linear` layers
named by `names` (default `{"embed": "embed", "head": "head"}`). Per layer: `self_attn.in_proj_*`
(queries, keys and values stacked) and `out_proj.*`, `linear1.*`, `linear2.*`, `norm1.*`,
`norm2.*`, and for a decoder `multihead_attn.*` and `norm3.*`. A `Linear`'s weight `(out, in)`
becomes a `(in, out)` matrix. Positions are not weights in PyTorch's layers: the model adds its
own (sinusoidal by default). Every tensor must be used, and every weight of the model filled:
anything else is an `InteropError` naming it.
"""

import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .checkpoints.families import FAMILIES
from .checkpoints.single import ModelConfig
from .checkpoints.trees import CheckpointError, fill_tree, skeleton, slots
from .nn.blocks.transformer_block import TransformerBlock
from .nn.layers.basic import Dense, LayerNorm

__all__ = ["InteropError", "import_torch", "read_state_dict"]


class InteropError(ValueError):
    """A state dict that does not fit the model it is imported into."""


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """A state dict saved as safetensors (`safetensors.torch.save_file(model.state_dict(), p)`)."""
    from safetensors.numpy import load_file

    try:
        return load_file(str(pathlib.Path(path)))
    except Exception as error:  # safetensors raises several types for a bad file
        raise InteropError(f"cannot read the state dict {path}: {error}") from None


def _tensor(name: Any, value: Any) -> np.ndarray:
    """A state dict's tensor as float32 NumPy, refused (naming it) unless it is a finite array
    of numbers."""
    if not isinstance(name, str):
        raise InteropError(f"a state dict's keys are tensor names; received the key {name!r}.")
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise InteropError(
            f"the state dict's {name!r} must be an array; received {type(value).__name__}."
        )
    try:
        array = np.asarray(value, np.float32)
    except (TypeError, ValueError) as error:
        raise InteropError(
            f"the state dict's {name!r} is not an array of numbers: {error}"
        ) from None
    if not np.isfinite(array).all():
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise InteropError(
            f"the state dict's {name!r} holds {bad} non-finite value(s) (NaN or infinity): "
            "refusing to import weights that would make every output NaN."
        )
    return array


class _Rows:
    """Rows `[start, stop)` of a `(total, ...)` tensor (one of PyTorch's stacked query, key and
    value projections), transposed for a weight."""

    def __init__(self, start: int, stop: int, total: int, transpose: bool):
        self.start, self.stop, self.total, self.transpose = start, stop, total, transpose

    def __call__(self, a: np.ndarray) -> np.ndarray:
        rows = a[self.start : self.stop]
        return rows.T if self.transpose else rows


def _source_shape(convert: Any, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The whole shape that the tensor converted by `convert` into an array of shape `ours` must
    have."""
    if isinstance(convert, _Rows):
        inner = ours[::-1] if convert.transpose else ours
        return (convert.total, *inner[1:])
    return ours[::-1] if convert is np.transpose else ours


def _attention(prefix: str, d_model: int) -> dict[str, tuple[str, Any]]:
    """Our attention's arrays from PyTorch's `nn.MultiheadAttention` at `prefix`."""
    parts: dict[str, tuple[str, Any]] = {}
    for i, which in enumerate("QKV"):
        start, stop = i * d_model, (i + 1) * d_model
        weight, bias = _Rows(start, stop, 3 * d_model, True), _Rows(start, stop, 3 * d_model, False)
        parts[f"W_{which}"] = (f"{prefix}.in_proj_weight", weight)
        parts[f"b_{which}"] = (f"{prefix}.in_proj_bias", bias)
    parts["W_O"] = (f"{prefix}.out_proj.weight", np.transpose)
    parts["b_O"] = (f"{prefix}.out_proj.bias", np.asarray)
    return parts


def _linear(prefix: str) -> dict[str, tuple[str, Any]]:
    return {"W": (f"{prefix}.weight", np.transpose), "b": (f"{prefix}.bias", np.asarray)}


def _norm(prefix: str) -> dict[str, tuple[str, Any]]:
    return {"gain": (f"{prefix}.weight", np.asarray), "bias": (f"{prefix}.bias", np.asarray)}


def _block(prefix: str, d_model: int, decoder: bool) -> dict[str, tuple[str, Any]]:
    """Our block's arrays (by attribute path) from PyTorch's layer at `prefix`."""
    parts: dict[str, tuple[str, Any]] = {}
    attention = "self_attention" if decoder else "attention"
    for name, source in _attention(f"{prefix}.self_attn", d_model).items():
        parts[f".{attention}.{name}"] = source
    norms = ("norm1", "norm2", "norm3") if decoder else ("norm1", "norm2")
    for norm in norms:
        for name, source in _norm(f"{prefix}.{norm}").items():
            parts[f".{norm}.{name}"] = source
    if decoder:
        for name, source in _attention(f"{prefix}.multihead_attn", d_model).items():
            parts[f".cross_attention.{name}"] = source
    for ours, theirs in (("hidden", "linear1"), ("out", "linear2")):
        for name, source in _linear(f"{prefix}.{theirs}").items():
            parts[f".feed_forward.{ours}.{name}"] = source
    return parts


def import_torch(
    state: Mapping[str, Any] | str | os.PathLike[str],
    config: ModelConfig,
    names: Mapping[str, str] | None = None,
) -> Any:
    """The model `config` builds, with the weights of the PyTorch state dict `state` (a mapping
    of arrays, or the path of a safetensors file); see the module's docstring for the names."""
    if not isinstance(config, ModelConfig):
        raise InteropError(
            f"`config` must be a ModelConfig (the model to import into); received "
            f"{type(config).__name__}."
        )
    try:  # one validation of the config: it must build a model, before any tensor is read
        model = skeleton(config)
    except CheckpointError as error:
        raise InteropError(str(error)) from None
    if not isinstance(state, Mapping):
        state = read_state_dict(state)
    state = {str(k): _tensor(k, v) for k, v in state.items()}
    names = {"embed": "embed", "head": "head", **(names or {})}
    if config.arguments.get("scan_layers"):
        raise InteropError(
            "import into the unrolled model (scan_layers=False), then stack it with "
            "`stack_layers` or load its checkpoint with `scan_layers=True`."
        )
    decoder = FAMILIES[config.factory].kind == "decoder"
    depth = int(config.arguments["depth"])
    stack = _stack_prefix(state, depth)
    embed, head, blocks, final = _places(model, decoder, depth)
    plan: dict[str, tuple[str, Any]] = {}
    for path, source in _linear(names["embed"]).items():
        plan[f"{embed}.{path}.value"] = source
    for path, source in _linear(names["head"]).items():
        plan[f"{head}.{path}.value"] = source
    d_model = int(config.arguments["d_model"])
    for i, block in enumerate(blocks):
        for path, source in _block(f"{stack}layers.{i}", d_model, decoder).items():
            plan[f"{block}{path}.value"] = source
    for path, source in _norm(f"{stack}norm").items():
        plan[f"{final}.{path}.value"] = source
    arrays = _arrays(slots(model), plan, state)
    try:
        return fill_tree(model, arrays)
    except CheckpointError as error:
        raise InteropError(f"the state dict does not fit the model: {error}") from None


def _stack_prefix(state: Mapping[str, Any], depth: int) -> str:
    """The prefix of the state dict's one stack of layers (`encoder.`, `decoder.`, ...), whose
    layers must be `0 .. depth - 1`."""
    found = sorted(
        {m.group(1) for k in state if (m := re.match(r"^(.*?)layers\.\d+\.(self_attn|linear1)", k))}
    )
    if len(found) != 1:
        raise InteropError(
            f"expected one stack of layers named `<prefix>layers.<i>.` in the state dict; found "
            f"{found or 'none'}."
        )
    stack = found[0]
    pattern = rf"^{re.escape(stack)}layers\.(\d+)\."
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(pattern, k))})
    if layers != list(range(depth)):
        raise InteropError(
            f"the state dict's stack has layers {layers}; the model has depth {depth}."
        )
    return stack


def _places(model: Any, decoder: bool, depth: int) -> tuple[str, str, list[str], str]:
    """The paths in `model` of the input projection, the output projection, each block and the
    final LayerNorm (`.none` for a model without one)."""
    if decoder:
        return ".embed", ".head", [f".blocks[{i}]" for i in range(depth)], ".final_norm"
    layers = model.layers
    dense = [i for i, layer in enumerate(layers) if isinstance(layer, Dense)]
    blocks = [
        f".layers[{i}]" for i, layer in enumerate(layers) if isinstance(layer, TransformerBlock)
    ]
    norms = [i for i, layer in enumerate(layers) if isinstance(layer, LayerNorm)]
    final = f".layers[{norms[0]}]" if norms else ".none"
    return f".layers[{dense[0]}]", f".layers[{dense[-1]}]", blocks, final


def _arrays(
    ours: Mapping[str, Any], plan: Mapping[str, tuple[str, Any]], state: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """Every array of the model (`ours`: path -> slot) from the tensor `plan` names, each checked
    whole against the shape the model needs; every tensor of `state` must be used."""
    arrays, used = {}, set()
    for path, slot in ours.items():
        if path not in plan:
            raise InteropError(f"no PyTorch tensor maps to the model's {path}.")
        name, convert = plan[path]
        if name not in state:
            raise InteropError(f"the state dict lacks {name!r} (for the model's {path}).")
        want = _source_shape(convert, tuple(slot.shape))
        if state[name].shape != want:  # the whole tensor, not only the rows taken
            raise InteropError(
                f"the state dict's {name!r} has shape {state[name].shape}; the model "
                f"({path}) needs shape {want}."
            )
        arrays[path] = np.ascontiguousarray(convert(state[name]))
        used.add(name)
    unused = sorted(set(state) - used)
    if unused:
        raise InteropError(
            f"the model has no place for {unused[:5]}{' ...' if len(unused) > 5 else ''}: "
            "build it with the PyTorch model's options (use_bias=True for its attention biases, "
            "norm_first=True for a final norm, ...)."
        )
    return arrays
