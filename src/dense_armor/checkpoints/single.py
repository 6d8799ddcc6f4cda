"""Checkpoints: a model's config (JSON) and weights (safetensors), written atomically. No pickle.

A checkpoint is a directory:

- `config.json`: `{"format": "dense_armor.checkpoint", "version": 1, "factory": ..., "arguments":
  {...}}`, enough to rebuild the model's structure (`ModelConfig.build`);
- `weights.safetensors`: every array of the model, keyed by its PyTree path (`.layers[0].W.value`);
- optionally `state.safetensors` and `state.json`: arrays and JSON of a training run (optimizer
  state, step, history) so that `fit` can resume.

`config.json` also records the sha256 of every other file (`"files"`), and `load_checkpoint`
refuses a file whose bytes changed.

`save_checkpoint` writes the whole directory beside the target (`.<name>.XXXX`) and renames it into
place, so a reader sees the old checkpoint or the new one, never a mixture. Replacing moves the old
one aside to `<dir>.previous` first; if the process dies between the two renames,
`load_checkpoint` reads `<dir>.previous`, and the next save puts it back before anything else. No
sequence of kills loses the last complete checkpoint; the next save removes what killed saves left.
It refuses to replace a directory that is not a checkpoint.
"""

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors import SafetensorError
from safetensors.numpy import load_file

from ..nn.core import is_integer, python_scalar, require_bool
from ..nn.models.stack import stack_layers, unstack_layers
from . import atomic
from .atomic import WRITE_STEPS, sha256
from .families import FAMILIES
from .tensors import write_safetensors
from .trees import (
    CheckpointError,
    check_arrays,
    check_fits,
    fill_tree,
    skeleton,
    slots,
    tree_arrays,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "WRITE_STEPS",
    "Checkpoint",
    "CheckpointError",
    "ModelConfig",
    "check_arrays",
    "check_fits",
    "convert_layers",
    "fill_tree",
    "load_checkpoint",
    "save_checkpoint",
    "skeleton",
    "tree_arrays",
]

FORMAT = "dense_armor.checkpoint"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model factory's name and its arguments (all but the key), e.g.
    `ModelConfig("transformer_encoder", {"n_in": 8, "d_model": 64, ...})`."""

    factory: str
    arguments: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or self.factory not in FAMILIES:
            raise CheckpointError(
                f"unknown model factory {self.factory!r}; known: {sorted(FAMILIES)}."
            )
        if not isinstance(self.arguments, Mapping):
            raise CheckpointError(
                f"a model config's `arguments` must be a dict of the factory's arguments; "
                f"received {type(self.arguments).__name__}."
            )
        # NumPy scalars (np.int64(8)) are welcome, stored as the Python values JSON can hold,
        # and tuples as lists: a config equals itself read back from its JSON.
        plain = {name: _json_value(value) for name, value in self.arguments.items()}
        object.__setattr__(self, "arguments", plain)

    def build(self, key: jax.Array | None = None) -> Any:
        """The model, with fresh weights from `key` (default `PRNGKey(0)`)."""
        key = jax.random.PRNGKey(0) if key is None else key
        return FAMILIES[self.factory].factory(**dict(self.arguments), key=key)

    def causal(self) -> "ModelConfig":
        """The config of this model's causal form (the model whose step streams and exports)."""
        return ModelConfig(self.factory, FAMILIES[self.factory].causal(self.arguments))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "factory": self.factory,
            "arguments": dict(sorted(self.arguments.items())),  # one order, whatever the source
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(data, Mapping):
            raise CheckpointError(
                f"not a dense_armor checkpoint config: a JSON {type(data).__name__}, not an object."
            )
        if data.get("format") != FORMAT:
            raise CheckpointError(
                f"not a dense_armor checkpoint config: format={data.get('format')!r}."
            )
        if data.get("version") != VERSION:
            raise CheckpointError(
                f"checkpoint config version {data.get('version')!r} is not supported "
                f"(this dense_armor reads version {VERSION})."
            )
        missing = [key for key in ("factory", "arguments") if key not in data]
        if missing:
            raise CheckpointError(f"the checkpoint config lacks {', '.join(map(repr, missing))}.")
        return cls(data["factory"], data["arguments"])


def _json_value(value: Any) -> Any:
    """`value` as JSON reads it back: NumPy scalars as Python ones, tuples as lists."""
    if isinstance(value, tuple | list):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json_value(v) for k, v in value.items()}
    return python_scalar(value)


@dataclasses.dataclass
class Checkpoint:
    """What `load_checkpoint` returns: the model, its config, and any training state."""

    model: Any
    config: ModelConfig
    state_arrays: dict[str, np.ndarray]
    state: dict[str, Any]


def _write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


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

    Refuses (`CheckpointError`) a model whose arrays do not fit `config` and a `directory` that
    exists but is not a checkpoint.

    **Returns:** the directory's path.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(
            f"save_checkpoint: `config` must be a ModelConfig, e.g. ModelConfig(factory, "
            f"arguments); received {type(config).__name__}."
        )
    target = pathlib.Path(directory)
    weights = tree_arrays(model)
    expected = slots(skeleton(config))
    try:
        check_arrays(expected, weights, what=f"arrays of the model saved to {target}")
    except CheckpointError as error:
        culprits = _culprits(config, expected, weights)
        raise CheckpointError(
            f"save_checkpoint: the config disagrees with the model{culprits}: {error}"
        ) from None
    if jax.process_count() > 1:
        if jax.process_index() == 0:
            _write_checkpoint(target, weights, config, state_arrays, state)
        multihost_utils.sync_global_devices(f"dense_armor checkpoint {target}")
        return target
    return _write_checkpoint(target, weights, config, state_arrays, state)


def _culprits(config: ModelConfig, expected: Mapping[str, Any], arrays: Mapping[str, Any]) -> str:
    """Which of `config`'s integer arguments the first shape mismatch points at: those whose
    value is a size the config builds where the model has another (" (likely in `d_model=12`:
    the model has 8 where the config builds 12)"), or "" when no argument stands out."""
    for path, want in expected.items():
        got = arrays.get(path)
        if got is None or tuple(got.shape) == tuple(want.shape) or got.ndim != len(want.shape):
            continue
        differing = [(w, g) for w, g in zip(want.shape, got.shape, strict=True) if w != g]
        named = [
            f"`{name}={value}`"
            for name, value in sorted(config.arguments.items())
            if is_integer(value) and any(value == w for w, _ in differing)
        ]
        if named:
            return (
                f" (likely in {' or '.join(named)}: the model has {differing[0][1]} where the "
                f"config builds {differing[0][0]})"
            )
        return ""
    return ""


def _is_checkpoint(path: pathlib.Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _write_checkpoint(
    target: pathlib.Path,
    weights: dict[str, np.ndarray],
    config: ModelConfig,
    state_arrays: Mapping[str, np.ndarray] | None,
    state: Mapping[str, Any] | None,
) -> pathlib.Path:
    if target.is_file() or (
        target.is_dir() and any(target.iterdir()) and not _is_checkpoint(target)
    ):
        raise CheckpointError(
            f"refusing to replace {target}: it exists and is not a dense_armor checkpoint "
            "(no config.json of one). Save to another directory, or remove it first."
        )

    def fill(tmp: pathlib.Path) -> None:
        write_safetensors(weights, tmp / "weights.safetensors", metadata={"format": FORMAT})
        if state_arrays is not None:
            write_safetensors(state_arrays, tmp / "state.safetensors")
        if state is not None:
            _write_json(tmp / "state.json", dict(state))
        atomic.reached("files written")
        files = {f.name: sha256(f) for f in sorted(tmp.iterdir())}
        _write_json(tmp / "config.json", {**config.to_json(), "files": files})  # written last

    return atomic.write_directory(target, fill)


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


def _verify_files(path: pathlib.Path, files: Any) -> None:
    """Each file that config.json lists must be there with the bytes it had when saved."""
    if files is None:  # written before checksums were recorded
        return
    if not isinstance(files, dict):
        raise CheckpointError(f"corrupt config.json in {path}: `files` is not an object.")
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"missing file: {file} (listed in {path / 'config.json'})")
        if sha256(file) != digest:
            raise CheckpointError(
                f"{file} is corrupt: its sha256 differs from the one recorded when it was saved."
            )


def load_checkpoint(
    directory: str | os.PathLike[str], *, scan_layers: bool | None = None
) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`, checking structure, shapes and dtypes.

    `scan_layers`: `True` or `False` converts the model to stacked (one `Stack` of its blocks)
    or unrolled blocks if it was saved the other way, and its config with it; the weights and
    the outputs are the same. `None` (default): as saved."""
    path = pathlib.Path(directory)
    previous = atomic.previous_copy(path)
    if not path.exists() and previous.is_dir():
        path = previous  # a replacement was interrupted between its two renames
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    data = _read_json(path / "config.json")
    try:
        config = ModelConfig.from_json(data)
    except CheckpointError as error:
        raise CheckpointError(f"{path / 'config.json'}: {error}") from None
    _verify_files(path, data.get("files"))
    model = fill_tree(skeleton(config), _read_safetensors(path / "weights.safetensors"))
    state_arrays = (
        _read_safetensors(path / "state.safetensors")
        if (path / "state.safetensors").exists()
        else {}
    )
    state = _read_json(path / "state.json") if (path / "state.json").exists() else {}
    if scan_layers is not None:
        model, config = convert_layers(model, config, scan_layers)
    return Checkpoint(model, config, state_arrays, state)


def convert_layers(model: Any, config: ModelConfig, scan_layers: bool) -> tuple[Any, ModelConfig]:
    """`model` and `config` with the blocks stacked (`scan_layers=True`) or unrolled."""
    require_bool(scan_layers=scan_layers)
    if bool(config.arguments.get("scan_layers", False)) == scan_layers:
        return model, config
    model = (stack_layers if scan_layers else unstack_layers)(model)
    config = ModelConfig(config.factory, {**config.arguments, "scan_layers": scan_layers})
    check_fits(config, tree_arrays(model))
    return model, config
