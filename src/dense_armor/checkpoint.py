"""Checkpoints: a model's config (JSON) and weights (safetensors), written atomically. No pickle.

A checkpoint is a directory:

- `config.json`: `{"format": "dense_armor.checkpoint", "version": 1, "factory": ..., "arguments":
  {...}}`, enough to rebuild the model's structure (`ModelConfig.build`);
- `weights.safetensors`: every array of the model, keyed by its PyTree path (`.layers[0].W.value`);
- optionally `state.safetensors` and `state.json`: arrays and JSON of a training run (optimizer
  state, step, history) so that `fit` can resume.

`save_checkpoint` writes the whole directory beside the target and renames it into place, so a
reader sees the old checkpoint or the new one, never a mixture; if the process dies between the two
renames of a replacement, `load_checkpoint` finds the previous checkpoint in `<dir>.previous`.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .distributed import gather_to_host
from .utility.neural.models import transformer_decoder, transformer_encoder

__all__ = [
    "FORMAT",
    "VERSION",
    "Checkpoint",
    "CheckpointError",
    "ModelConfig",
    "fill_tree",
    "load_checkpoint",
    "save_checkpoint",
    "tree_arrays",
]

FORMAT = "dense_armor.checkpoint"
VERSION = 1
FACTORIES: dict[str, Callable[..., Any]] = {
    "transformer_encoder": transformer_encoder,
    "transformer_decoder": transformer_decoder,
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, of an unknown version, or does not fit its model."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model factory's name and its arguments (all but the key), e.g.
    `ModelConfig("transformer_encoder", {"n_in": 8, "d_model": 64, ...})`."""

    factory: str
    arguments: Mapping[str, Any]

    def __post_init__(self) -> None:
        if self.factory not in FACTORIES:
            raise CheckpointError(
                f"unknown model factory {self.factory!r}; known: {sorted(FACTORIES)}."
            )

    def build(self, key: jax.Array | None = None) -> Any:
        """The model, with fresh weights from `key` (default `PRNGKey(0)`)."""
        key = jax.random.PRNGKey(0) if key is None else key
        return FACTORIES[self.factory](**dict(self.arguments), key=key)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "factory": self.factory,
            "arguments": dict(self.arguments),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ModelConfig":
        if data.get("format") != FORMAT:
            raise CheckpointError(
                f"not a dense_armor checkpoint config: format={data.get('format')!r}."
            )
        if data.get("version") != VERSION:
            raise CheckpointError(
                f"checkpoint config version {data.get('version')!r} is not supported "
                f"(this dense_armor reads version {VERSION})."
            )
        return cls(data["factory"], data["arguments"])


def tree_arrays(tree: Any) -> dict[str, np.ndarray]:
    """Every array leaf of `tree`, as NumPy, keyed by its PyTree path. Sharded arrays are gathered
    whole (across processes too, so every process must call it)."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {jax.tree_util.keystr(path): gather_to_host(leaf) for path, leaf in leaves}


def fill_tree(skeleton: Any, arrays: Mapping[str, np.ndarray], what: str = "weights") -> Any:
    """`skeleton` with each array leaf replaced by `arrays[path]`; structure, shape and dtype are
    checked, and every mismatch is named."""
    expected = tree_arrays(skeleton)
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
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(
                f"the {what} at {path} have shape {got.shape} and dtype {got.dtype}; the model "
                f"expects shape {want.shape} and dtype {want.dtype}."
            )
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    leaves = [
        jax.numpy.asarray(arrays[jax.tree_util.keystr(path)]) if eqx.is_array(leaf) else leaf
        for path, leaf in paths_and_leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


@dataclasses.dataclass
class Checkpoint:
    """What `load_checkpoint` returns: the model, its config, and any training state."""

    model: Any
    config: ModelConfig
    state_arrays: dict[str, np.ndarray]
    state: dict[str, Any]


def _write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: Any,
    config: ModelConfig,
    *,
    state_arrays: Mapping[str, np.ndarray] | None = None,
    state: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Write `model` and `config` (and optionally a training state) to `directory`, atomically.

    A sharded model is gathered whole first; with several processes, every process calls this,
    process 0 writes, and all return once the checkpoint is in place.

    **Returns:** the directory's path.
    """
    target = pathlib.Path(directory)
    weights = tree_arrays(model)
    if jax.process_count() > 1:
        if jax.process_index() == 0:
            _write_checkpoint(target, weights, config, state_arrays, state)
        multihost_utils.sync_global_devices(f"dense_armor checkpoint {target}")
        return target
    return _write_checkpoint(target, weights, config, state_arrays, state)


def _write_checkpoint(
    target: pathlib.Path,
    weights: dict[str, np.ndarray],
    config: ModelConfig,
    state_arrays: Mapping[str, np.ndarray] | None,
    state: Mapping[str, Any] | None,
) -> pathlib.Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_json(tmp / "config.json", config.to_json())
        save_file(weights, str(tmp / "weights.safetensors"), metadata={"format": FORMAT})
        if state_arrays is not None:
            save_file(dict(state_arrays), str(tmp / "state.safetensors"))
        if state is not None:
            _write_json(tmp / "state.json", dict(state))
        for file in tmp.iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(tmp)
        previous = target.with_name(target.name + ".previous")
        if previous.exists():
            shutil.rmtree(previous)
        if target.exists():
            os.rename(target, previous)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
        shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"corrupt or unreadable safetensors file {path}: {error}") from None


def _read_json(path: pathlib.Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"corrupt JSON in {path}: {error}") from None


def load_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`, checking structure, shapes and dtypes."""
    path = pathlib.Path(directory)
    previous = path.with_name(path.name + ".previous")
    if not path.exists() and previous.is_dir():
        path = previous  # a replacement was interrupted between its two renames
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    config = ModelConfig.from_json(_read_json(path / "config.json"))
    try:
        skeleton = config.build()
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"the config in {path} does not build a model: {error}") from None
    model = fill_tree(skeleton, _read_safetensors(path / "weights.safetensors"))
    state_arrays = (
        _read_safetensors(path / "state.safetensors")
        if (path / "state.safetensors").exists()
        else {}
    )
    state = _read_json(path / "state.json") if (path / "state.json").exists() else {}
    return Checkpoint(model, config, state_arrays, state)
