"""A Hugging Face model directory's files, read without torch or transformers: `config.json`, the
tensors of `model.safetensors` (or of the shards `model.safetensors.index.json` names), each taken
once with its shape and values checked, the config's options read and checked by name, and the
tokenizer. Errors are `HuggingFaceError`, naming the file and the tensor or option."""

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["HuggingFaceError", "Tensors", "load_tokenizer", "option", "read_config", "refuse"]


class HuggingFaceError(ValueError):
    """A Hugging Face model directory that cannot be imported as it is."""


def read_config(root: pathlib.Path) -> dict[str, Any]:
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


def option(config: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = config.get(name, default)
    if value is None and default is None:
        return None
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise HuggingFaceError(f"config.json: `{name}` is {value!r}; expected a {kind}.")
    return value


def refuse(config: dict[str, Any], name: str, allowed: Callable[[Any], bool], what: str) -> None:
    if name in config and not allowed(config[name]):
        raise HuggingFaceError(
            f"config.json: `{name}={config[name]!r}` ({what}) is not implemented by TransformerLM; "
            "refusing rather than ignoring it."
        )


def read_tensors(root: pathlib.Path) -> dict[str, tuple[Any, pathlib.Path]]:
    """Where every tensor of the directory's safetensors files is (an open file, read one tensor
    at a time, so importing never holds the checkpoint twice), with the file's path."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({root / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise HuggingFaceError(f"{index}: not a readable shard index ({error!r}).") from None
    else:
        files = [root / "model.safetensors"]
    tensors: dict[str, tuple[Any, pathlib.Path]] = {}
    for path in files:
        if not path.is_file():
            raise HuggingFaceError(f"{path} is missing.")
        try:
            handle = SafetensorsFile(path)
            names = list(handle.entries)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise HuggingFaceError(f"{path} is not a readable safetensors file: {error}") from None
        for name in names:
            if name in tensors:
                raise HuggingFaceError(f"{path}: tensor {name!r} is also in {tensors[name][1]}.")
            tensors[name] = (handle, path)
    if index.exists():
        listed = set(weight_map)
        if listed != set(tensors):
            raise HuggingFaceError(
                f"{index} lists other tensors than the shards hold: "
                f"{sorted(listed ^ set(tensors))[:5]}."
            )
    return tensors


DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip


class SafetensorsFile:
    """A safetensors file read one tensor at a time with plain reads (no memory map, whose pages
    would count once more in the importer's memory): the header checked whole when opened (its
    offsets inside the file, which they must fill), bfloat16 as NumPy's view of JAX's type (the
    bytes read, no copy)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        self.start, self.entries = 8 + length, header
        ends = [self._check(name, entry) for name, entry in header.items()]
        if self.start + max(ends, default=0) != size:
            raise ValueError(
                f"the tensors end at byte {self.start + max(ends, default=0)} of {size}"
            )

    def _check(self, name: str, entry: dict[str, Any]) -> int:
        begin, end = entry["data_offsets"]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if (
            entry["dtype"] not in DTYPES
            or end - begin != count * np.dtype(DTYPES[entry["dtype"]]).itemsize
        ):
            raise ValueError(
                f"tensor {name!r}: {entry['dtype']} {entry['shape']} in {end - begin} bytes"
            )
        return int(end)

    def get_tensor(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        begin = self.start + entry["data_offsets"][0]
        array = np.fromfile(
            self.path, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=begin
        )
        if entry["dtype"] == "BF16":
            array = array.view(jnp.bfloat16)
        return array.reshape(shape)


class Tensors:
    """The checkpoint's tensors, taken one by one (shape and finiteness checked); `done` refuses
    any left unused."""

    def __init__(
        self,
        root: pathlib.Path,
        tensors: dict[str, tuple[Any, pathlib.Path]],
        dtype: Any = np.float32,
    ):
        self.root, self.tensors, self.used = root, tensors, set[str]()
        self.dtype = np.dtype(dtype)  # what `take` gives: the model's parameter dtype

    def read(self, name: str) -> np.ndarray:
        """The tensor `name` as stored (read from its file now)."""
        handle, path = self.tensors[name]
        try:
            return handle.get_tensor(name)
        except (OSError, ValueError, TypeError) as error:
            raise HuggingFaceError(f"{path}: tensor {name!r} is not readable: {error}") from None

    def take(self, name: str, shape: tuple[int, ...], optional: bool = False) -> np.ndarray | None:
        """The tensor `name` in the model's dtype (float32 unless told: bfloat16 kept as read,
        widened exactly to float32), checked (`None` if `optional` and absent)."""
        if optional and name not in self.tensors:
            return None
        if name not in self.tensors:
            raise HuggingFaceError(f"{self.root}: the checkpoint has no tensor {name!r}.")
        array, path = self.read(name), self.tensors[name][1]
        if array.shape != shape:
            raise HuggingFaceError(
                f"{path}: tensor {name!r} has shape {array.shape}; the config asks for {shape}."
            )
        if not np.issubdtype(array.dtype, np.floating) and array.dtype.kind != "V":
            raise HuggingFaceError(f"{path}: tensor {name!r} is {array.dtype}, not floating point.")
        array = array.astype(self.dtype, copy=False)
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
