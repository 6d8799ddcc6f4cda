"""Models as trees of arrays keyed by PyTree path: the abstract skeleton a config builds, the
arrays of a model, and filling one with the other, every mismatch named. Checkpoints, exports and
imports all read and write models through these."""

import json
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..distributed import gather_to_host
from ..nn.sharding import is_slot

__all__ = [
    "CheckpointError",
    "check_arrays",
    "check_fits",
    "fill_tree",
    "skeleton",
    "slots",
    "tree_arrays",
]


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, of an unknown version, or does not fit its model."""


def tree_arrays(tree: Any) -> dict[str, np.ndarray]:
    """Every array leaf of `tree`, as NumPy, keyed by its PyTree path. Sharded arrays are gathered
    whole (across processes too, so every process must call it)."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {jax.tree_util.keystr(path): gather_to_host(leaf) for path, leaf in leaves}


def slots(tree: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The shape and dtype of every array leaf (or abstract array) of `tree`, by PyTree path."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_slot)
    return {
        jax.tree_util.keystr(path): jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        for path, leaf in leaves
        if is_slot(leaf)
    }


def skeleton(config: Any) -> Any:
    """The model `config` (a `ModelConfig`) builds, with abstract arrays
    (`eqx.filter_eval_shape`: no weights are computed), to fill with `fill_tree`. Traced once per
    config (a training run checks every checkpoint it saves against it); the skeleton holds no
    array, so one serves every caller."""
    try:
        # 64-bit mode changes the dtypes a factory's initialisers give
        key = json.dumps(
            [config.to_json(), bool(jax.config.read("jax_enable_x64"))], sort_keys=True
        )
    except TypeError:  # an argument JSON cannot hold: built each time (and refused when saved)
        return _build_skeleton(config)
    if key not in _SKELETONS:
        if len(_SKELETONS) >= 64:
            _SKELETONS.pop(next(iter(_SKELETONS)))
        _SKELETONS[key] = _build_skeleton(config)
    return _SKELETONS[key]


_SKELETONS: dict[str, Any] = {}  # by the config's JSON and the x64 mode; the oldest goes past 64


def _build_skeleton(config: Any) -> Any:
    try:
        return eqx.filter_eval_shape(config.build, jax.random.PRNGKey(0))
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"the config {config} does not build a model: {error}") from None


def check_arrays(
    expected: Mapping[str, Any], arrays: Mapping[str, Any], what: str = "weights"
) -> None:
    """Raise `CheckpointError` naming every path that `arrays` lacks or adds, or the first whose
    shape or dtype differs from `expected` (both keyed by PyTree path)."""
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(set(arrays) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"the {what} do not match the model's structure: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}."
        )
    for path, want in expected.items():
        got = arrays[path]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise CheckpointError(
                f"the {what} at {path} have shape {tuple(got.shape)} and dtype {got.dtype}; the "
                f"model expects shape {tuple(want.shape)} and dtype {want.dtype}."
            )


def check_fits(config: Any, arrays: Mapping[str, Any], what: str = "weights") -> None:
    """Raise `CheckpointError` unless `arrays` (by PyTree path) fit the model `config` builds,
    checked against its abstract skeleton (nothing is computed)."""
    check_arrays(slots(skeleton(config)), arrays, what)


def fill_tree(skeleton: Any, arrays: Mapping[str, np.ndarray], what: str = "weights") -> Any:
    """`skeleton` (a tree of arrays, or of `jax.ShapeDtypeStruct`s from `skeleton(config)`) with
    each array leaf replaced by `arrays[path]`; structure, shape and dtype are checked, and every
    mismatch is named."""
    check_arrays(slots(skeleton), arrays, what)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=is_slot)
    leaves = [
        jax.numpy.asarray(arrays[jax.tree_util.keystr(path)]) if is_slot(leaf) else leaf
        for path, leaf in paths_and_leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)
