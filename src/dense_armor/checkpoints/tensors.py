"""The one way the package writes a safetensors file: `write_safetensors`.

safetensors' NumPy writer copies each array's memory as it lies (`ctypes.data`, `nbytes`), so an
array that is not C-contiguous goes out in its own order, silently permuted. An array read back
from an accelerator can be one: on a TPU, `np.asarray(x)` may give a view in the device buffer's
layout (a matrix column-major, say). Every array is therefore made row-major first; nothing the
package writes depends on the memory layout of the device the values came from.
"""

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors.numpy import save_file

__all__ = ["row_major", "write_safetensors"]


def row_major(value: Any) -> np.ndarray:
    """`value` as a C-contiguous NumPy array of its own shape (a copy only where it is not one;
    `np.ascontiguousarray` would turn a scalar into one element)."""
    return np.asarray(value, order="C")


def write_safetensors(
    arrays: Mapping[str, Any], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> None:
    """`arrays` written to `path` as safetensors, each row-major (see the module)."""
    save_file({name: row_major(a) for name, a in arrays.items()}, str(path), metadata=metadata)
