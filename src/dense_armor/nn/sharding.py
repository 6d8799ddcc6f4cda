"""How a model and its caches lie on a device mesh: the plan (`partition_specs`) that training,
checkpoints, generation and the server share, and the placement of a model and of its caches for
generation over the `"model"` axis (tensor parallelism: see `dense_armor.distributed`).

A layer says which of its arrays split over `"model"`, and along which axis, in its
`tensor_parallel` class attribute (an attention layer's heads, a feed-forward's hidden units);
every other array is replicated. A cache's keys and values (and an int8 cache's scales) split over
their key/value heads, the axis `-3` of every layout (`(..., n_kv_heads, capacity, d_head)`,
a page pool's `(..., pages, n_kv_heads, page_size, d_head)`), so each device keeps the rows of the
heads it computes; every other piece of a cache (counters, tables, recurrent states) is
replicated."""

import contextlib
import dataclasses
import functools
import operator
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .core import Layer, require_bool
from .state.cache import FixedKVCache, RingKVCache
from .state.paged import PagedKVCache

__all__ = [
    "AXES",
    "ShardingWarning",
    "axis_size",
    "cache_shardings",
    "cache_specs",
    "check_mesh",
    "check_serving_mesh",
    "is_slot",
    "laid_out",
    "on_mesh",
    "partition_specs",
    "place_model",
    "shard_caches",
    "shardings",
]

AXES = ("data", "model")


class ShardingWarning(UserWarning):
    """Arrays that `shard_params=True` could not split: no axis of theirs divides the mesh."""


def check_mesh(caller: str, mesh: Any) -> None:
    """A `ValueError` unless `mesh` is a `jax.sharding.Mesh` (or, to plan without devices, an
    `AbstractMesh`) with a `"data"` axis and no axis but `"data"` and `"model"`."""
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"{caller}: `mesh` must be a jax.sharding.Mesh (`data_mesh()`, `device_mesh()`); "
            f"received {type(mesh).__name__}."
        )
    names = tuple(mesh.axis_names)
    if "data" not in names or not set(names) <= set(AXES):
        raise ValueError(
            f'{caller}: a mesh\'s axes are `"data"` and, optionally, `"model"`; received {names}.'
        )
    if 0 in dict(mesh.shape).values():
        raise ValueError(f"{caller}: the mesh holds no device (its shape is {dict(mesh.shape)}).")


def axis_size(mesh: Mesh | AbstractMesh, name: str) -> int:
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


def _split_axes(tree: Any, model: int) -> dict[int, int]:
    """`{id(array): axis}` for the arrays that tensor parallelism splits over `model` devices, from
    the `tensor_parallel` declarations of the layers in `tree`; a `ValueError` where the axis
    cannot be split into whole heads (or units)."""
    found: dict[int, int] = {}

    def visit(node: Any, where: str) -> None:
        if isinstance(node, Layer):
            for path, (axis, groups) in type(node).tensor_parallel.items():
                param: Any = node
                for part in path.split("."):
                    param = getattr(param, part, None)
                if param is None:  # an optional bias the layer was built without
                    continue
                value = param.value
                count = value.shape[axis] if groups is None else getattr(node, groups)
                if value.shape[axis] % model or count % model:
                    what = f"{count} {groups or 'units'}"
                    raise ValueError(
                        f"tensor parallelism: {where}.{path} ({type(node).__name__}, {what}) "
                        f'cannot be split over {model} `"model"` devices; choose a `model` '
                        f"axis that divides {count}."
                    )
                found[id(value)] = axis
        if isinstance(node, eqx.Module):
            for field in dataclasses.fields(node):
                visit(getattr(node, field.name, None), f"{where}.{field.name}")
        elif isinstance(node, list | tuple):
            for i, child in enumerate(node):
                visit(child, f"{where}[{i}]")
        elif isinstance(node, dict):
            for name, child in node.items():
                visit(child, f"{where}[{name!r}]")

    visit(tree, "model")
    return found


def partition_specs(tree: Any, mesh: Mesh | AbstractMesh, shard_params: bool = False) -> Any:
    """The `PartitionSpec` of every array (or `jax.ShapeDtypeStruct`) of `tree` (a model) on
    `mesh` (a `Mesh`, or an `AbstractMesh((2, 2), ("data", "model"))` to plan without the
    devices), `None` for the other leaves: its tensor-parallel axis (see the module's
    docstring) on `"model"` when the mesh has that axis, and with `shard_params`, its first
    other axis that the `"data"` devices divide on `"data"`. Arrays that `shard_params` cannot
    split stay whole on every device, and a `ShardingWarning` lists them."""
    check_mesh("partition_specs", mesh)
    require_bool(shard_params=shard_params)
    model, data = axis_size(mesh, "model"), axis_size(mesh, "data")
    split = _split_axes(tree, model) if model > 1 else {}
    whole: list[str] = []

    def spec(path: Any, leaf: Any) -> P | None:
        if not is_slot(leaf):
            return None
        axes: list[Any] = [None] * leaf.ndim
        if id(leaf) in split:
            axes[split[id(leaf)] % leaf.ndim] = "model"
        if shard_params and data > 1:
            free = [i for i, n in enumerate(leaf.shape) if axes[i] is None and n % data == 0]
            both = [i for i, n in enumerate(leaf.shape) if axes[i] and n % (data * model) == 0]
            if free:
                axes[free[0]] = "data"
            elif both:  # a vector split over "model" is split over both axes at once
                axes[both[0]] = ("model", "data")
            else:
                whole.append(f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)}")
        while axes and axes[-1] is None:  # P("data") rather than P("data", None), as XLA says
            axes.pop()
        return P(*axes)

    specs = jax.tree_util.tree_map_with_path(spec, tree, is_leaf=is_slot)
    if whole:
        warnings.warn(
            f'shard_params: {len(whole)} arrays have no axis that the {data} `"data"` devices '
            f"divide and stay whole on every device: {', '.join(whole[:8])}"
            + (" ..." if len(whole) > 8 else ""),
            ShardingWarning,
            stacklevel=2,
        )
    return specs


def is_slot(leaf: Any) -> bool:
    """An array, or an abstract one (`jax.ShapeDtypeStruct`: a leaf of an `eqx.filter_eval_shape`
    skeleton), the leaves that placement and checkpoints fill."""
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def shardings(tree: Any, mesh: Mesh, shard_params: bool = False) -> Any:
    """The `NamedSharding` of every array (or abstract array) of `tree` on `mesh`, by
    `partition_specs`; `None` for the other leaves."""
    return jax.tree.map(
        lambda spec: None if spec is None else NamedSharding(mesh, spec),
        partition_specs(tree, mesh, shard_params),
        is_leaf=lambda x: x is None or isinstance(x, P),
    )


def check_serving_mesh(caller: str, mesh: Any) -> Mesh | None:
    """`mesh` (or None: one device) checked for generation: a `jax.sharding.Mesh` of this
    process's devices whose `"data"` axis holds one device (generation splits a model over
    `"model"` only), or a `TypeError`/`ValueError` naming `caller`."""
    if mesh is None:
        return None
    check_mesh(caller, mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{caller}: `mesh` must hold devices; received an abstract mesh.")
    if axis_size(mesh, "data") != 1:
        raise ValueError(
            f'{caller}: generation splits a model over the mesh\'s "model" axis only; this '
            f'mesh\'s "data" axis holds {axis_size(mesh, "data")} devices. Pass '
            "`device_mesh(model=N, devices=jax.devices()[:N])`."
        )
    if mesh.is_multi_process:
        raise ValueError(f"{caller}: `mesh` must hold this process's devices only.")
    return mesh


def place_model(model: Any, mesh: Mesh | None) -> Any:
    """`model` with every array on `mesh` as `partition_specs` says (heads and hidden units over
    `"model"`, the rest replicated); `model` itself without a mesh. Arrays already in place are
    not copied. A `ValueError` names a layer whose heads the axis does not divide."""
    if mesh is None:
        return model
    return jax.tree.map(
        lambda leaf, where: leaf if where is None else jax.device_put(leaf, where),
        model,
        shardings(model, mesh),
        is_leaf=lambda x: x is None,
    )


_SPLIT_BY_HEADS = ("keys", "values", "key_scale", "value_scale")


def _is_kv(node: Any) -> bool:
    return isinstance(node, FixedKVCache | RingKVCache | PagedKVCache)


def cache_specs(caches: Any) -> Any:
    """The `PartitionSpec` of every array of `caches` (a model's caches, of any batch of streams
    or stack of layers, or any tree holding them): keys, values and their scales split over
    their key/value heads (axis `-3`) on `"model"`, every other array replicated; `None` for the
    other leaves."""

    def one(node: Any) -> Any:
        out = jax.tree.map(lambda leaf: P() if is_slot(leaf) else None, node)
        if not _is_kv(node):
            return out
        for name in _SPLIT_BY_HEADS:
            buffer = getattr(node, name)
            if buffer is not None:
                heads = P(*([None] * (buffer.ndim - 3)), "model", None, None)
                out = eqx.tree_at(operator.attrgetter(name), out, heads)
        return out

    return jax.tree.map(one, caches, is_leaf=_is_kv)


def cache_shardings(caches: Any, mesh: Mesh) -> Any:
    """`cache_specs` as `NamedSharding`s on `mesh`."""
    return jax.tree.map(
        lambda spec: None if spec is None else NamedSharding(mesh, spec),
        cache_specs(caches),
        is_leaf=lambda x: x is None or isinstance(x, P),
    )


def shard_caches(caches: Any, mesh: Mesh | None = None) -> Any:
    """`caches` (or any tree holding them) laid out as `cache_specs` says, on `mesh` or, without
    one, on the mesh that `jax.set_mesh` made current if it has a `"model"` axis (inside a
    compiled function, a sharding constraint; outside, a placement); `caches` itself when
    there is neither."""
    if mesh is None:
        current = jax.sharding.get_abstract_mesh()
        if current.empty or "model" not in current.axis_names:
            return caches
        return jax.lax.with_sharding_constraint(caches, cache_specs(caches))
    return jax.lax.with_sharding_constraint(caches, cache_shardings(caches, mesh))


def on_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager[Any]:
    """`mesh` made current (`jax.set_mesh`) for generation over it, or nothing without one: the
    functions `laid_out` lay out their outputs on it, and `shard_caches` without a mesh reads
    it."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def laid_out(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` with its outputs laid out by `shard_caches` on the current mesh (`on_mesh`;
    generation's and the server's compiled functions): the same layout whatever the inputs
    came from, so that nothing compiles twice for a layout."""

    @functools.wraps(function)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return shard_caches(function(*args, **kwargs))

    return inner
