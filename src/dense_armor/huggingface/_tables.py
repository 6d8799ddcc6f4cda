"""The one mechanism every architecture's importer and writer share: a declared table of tensors.

An `Entry` names one tensor of a Hugging Face checkpoint (`model.layers.{i}.mlp.up_proj.weight`)
and the model's weights it holds (`blocks.{i}.feed_forward.W_up`), in torch's layout (`linear`:
a `torch.nn.Linear` matrix `(out, in)`, which the model holds transposed; `plain`: as the model
holds it, vectors and GPT-2's `Conv1D` matrices; `conv`: a depthwise `torch.nn.Conv1d` weight
`(channels, 1, kernel)`, held `(kernel, channels)`). A fused tensor (Phi-3's `qkv_proj`, GPT-2's
`c_attn`) names several weights, its last axis (in the model's layout) split into theirs, in
order; or, with `groups` (Qwen3.5's query and gate, `layout:groups` in a row), split into that
many groups (heads) first, each group holding a slice of every weight in turn. Importing takes
every entry's tensor (shape from the model, values finite) and leaves none unused; writing back
joins the same weights into the same names. The shapes come from the model built from the
arguments, so a table lists names and nothing else.
"""

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..nn.core import QuantizedParam
from ..nn.models.language_model import TransformerLM
from ._files import HuggingFaceError

__all__ = ["Entry", "Table", "fill", "gather", "per_layer"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint tensor: its name, the model weights it holds (paths of attributes, `.value`
    of each `Param`; `blocks.3` indexes the tuple of blocks) and its layout."""

    name: str
    paths: tuple[str, ...]
    layout: str = "linear"  # "linear" (torch's (out, in)) or "plain"
    optional: bool = False  # a tensor the architecture's checkpoints omit: zeros in the model
    # Several tensors stacked on a new leading axis into the one weight of `paths` (a mixture's
    # experts, `experts.{j}.w1.weight` for every j); `name` is then the first of them.
    stacked: tuple[str, ...] = ()
    groups: int = 1  # a fused tensor interleaved by groups (heads): see the module


Table = list[Entry]


def per_layer(
    depth: int,
    rows: Iterable[tuple[str, Any, str]],
    experts: int = 0,
    only: Sequence[int] | None = None,
) -> Table:
    """`rows` of `(name template, path template(s), layout)` with `{i}` for the layer, for every
    layer (or the layers `only`); a name with `{j}` (an expert) names `experts` tensors stacked
    into its one path."""
    table = []
    rows = list(rows)
    for i in range(depth) if only is None else only:
        for name, paths, layout in rows:
            paths = (paths,) if isinstance(paths, str) else paths
            stacked = tuple(name.format(i=i, j=j) for j in range(experts)) if "{j}" in name else ()
            kind, _, groups = layout.rstrip("?").partition(":")
            table.append(
                Entry(stacked[0] if stacked else name.format(i=i),
                      tuple(p.format(i=i) for p in paths), kind,
                      optional=layout.endswith("?"), stacked=stacked, groups=int(groups or 1))
            )  # fmt: skip
    return table


def _node(model: Any, path: str) -> Any:
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _model_layout(value: np.ndarray, layout: str) -> np.ndarray:
    if layout == "conv":
        return value[:, 0, :].T
    return value.T if layout == "linear" else value


def _torch_layout(value: np.ndarray, layout: str) -> np.ndarray:
    if layout == "conv":
        return value.T[:, None, :]
    return value.T if layout == "linear" else value


def _torch_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    if layout == "conv":
        return (shape[1], 1, shape[0])
    return shape[::-1] if layout == "linear" else shape


def _split(value: np.ndarray, widths: Sequence[int], groups: int) -> list[np.ndarray]:
    """A fused weight's last axis split into `widths`, in order or interleaved by groups."""
    lead = value.shape[:-1]
    grouped = value.reshape(*lead, groups, -1)
    parts = np.split(grouped, np.cumsum([w // groups for w in widths])[:-1], axis=-1)
    return [p.reshape(*lead, -1) for p in parts]


def _join(values: Sequence[np.ndarray], groups: int) -> np.ndarray:
    lead = values[0].shape[:-1]
    grouped = [v.reshape(*lead, groups, -1) for v in values]
    return np.concatenate(grouped, axis=-1).reshape(*lead, -1)


def fill(model: TransformerLM, table: Sequence[Entry], take: Callable[..., Any]) -> TransformerLM:
    """`model` (arrays, or the shapes of `eqx.filter_eval_shape`) with every entry's weights from
    `take(name, shape, optional)` (the checkpoint's tensor in torch's layout, or `None` for an
    optional one that is absent: zeros)."""
    for entry in table:
        if entry.stacked:
            model = _fill_stacked(model, entry, take)
            continue
        shapes = [_node(model, p).value.shape for p in entry.paths]
        dtype = _node(model, entry.paths[0]).value.dtype  # the model's parameter dtype
        widths = [s[-1] for s in shapes]
        ours = (*shapes[0][:-1], sum(widths))
        torch_shape = _torch_shape(ours, entry.layout)
        tensor = take(entry.name, torch_shape, entry.optional)
        if tensor is None:  # an optional tensor the checkpoint omits: zeros
            tensor = np.zeros(torch_shape, dtype)
        value = _model_layout(tensor, entry.layout)
        parts = _split(value, widths, entry.groups)
        for path, part in zip(entry.paths, parts, strict=True):

            def where(m: Any, path: str = path) -> Any:
                return _node(m, path).value

            model = eqx.tree_at(where, model, jnp.asarray(part, dtype))
    return model


def _fill_stacked(model: Any, entry: Entry, take: Callable[..., Any]) -> Any:
    """`entry`'s tensors stacked on a new leading axis into its one weight."""
    (path,) = entry.paths
    shape = _node(model, path).value.shape[1:]
    torch_shape = _torch_shape(shape, entry.layout)
    value = np.stack(
        [_model_layout(take(name, torch_shape), entry.layout) for name in entry.stacked]
    )

    def where(m: Any) -> Any:
        return _node(m, path).value

    return eqx.tree_at(where, model, jnp.asarray(value, _node(model, path).value.dtype))


def _stored(param: Any) -> np.ndarray:
    """A weight as a checkpoint stores it: as held, an int8 one dequantized to float32."""
    if isinstance(param, QuantizedParam):
        return np.asarray(param.array(jnp.float32))
    return np.asarray(param.value)


def gather(model: TransformerLM, table: Sequence[Entry]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors from `model`'s weights, by the same table (the inverse of
    `fill`)."""
    tensors = {}
    for entry in table:
        values = [_stored(_node(model, p)) for p in entry.paths]
        if entry.stacked:
            for name, value in zip(entry.stacked, values[0], strict=True):
                tensors[name] = np.ascontiguousarray(_torch_layout(value, entry.layout))
            continue
        if entry.optional and not any(v.any() for v in values):
            continue  # zeros the architecture does not store
        if entry.optional:
            raise HuggingFaceError(
                f"{entry.paths} hold values other than zeros, which {entry.name!r} would carry; "
                "the architecture's checkpoints have no such tensor (its models keep it zero)."
            )
        joined = _join(values, entry.groups) if len(values) > 1 else values[0]
        tensors[entry.name] = np.ascontiguousarray(_torch_layout(joined, entry.layout))
    return tensors
