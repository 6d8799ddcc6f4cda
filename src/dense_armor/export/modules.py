"""The exported modules written into an artifact's directory: each function's portable
`jax.export` artifact (symbolic shapes, every platform) and its static modules (one platform and
one shape each) with their manifest entries, and the C runner that runs the static modules
through a PJRT plugin."""

import contextlib
import importlib.metadata
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax import export

from . import standalone
from .functions import Function, strip_locations
from .lowering import Lowering

__all__ = ["write_portable", "write_runner", "write_static"]


def write_portable(
    tmp: pathlib.Path, functions: dict[str, Function], platforms: Sequence[str]
) -> tuple[dict[str, Any], bool]:
    """Each function's portable `jax.export` artifact (symbolic shapes, every platform); whether
    every one's debug locations were stripped."""
    exported = {}
    for name, function in functions.items():
        assert tuple(function.portable.platforms) == tuple(platforms), name
        exported[name] = function.portable
        (tmp / f"{name}.jax_exported").write_bytes(exported[name].serialize())
    return exported, all(f.stripped for f in functions.values())


def write_static(
    tmp: pathlib.Path,
    functions: dict[str, Function],
    lowering: Lowering,
    platforms: Sequence[str],
    shapes: list[dict[str, int]],
) -> tuple[list[dict[str, Any]], bool]:
    """The static modules (one platform, one shape each; a module identical to one already
    written is written once) and their manifest entries; whether every one's debug locations
    were stripped."""
    weights = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in lowering.weights]
    entries, stripped = [], []
    written: dict[bytes, str] = {}  # a module's bytes -> the stem it was written under
    (tmp / "static").mkdir()
    for platform in platforms:
        for name, function in functions.items():
            seen = set()
            for shape in shapes:
                sizes = {d: shape[d] for d in function.symbols}
                if tuple(sizes.items()) in seen:
                    continue
                seen.add(tuple(sizes.items()))
                module, done = strip_locations(
                    export.export(
                        function.jitted(donate=False, laid_out=True), platforms=(platform,)
                    )(*function.arguments(weights, sizes))
                )
                stripped.append(done)
                stem = ".".join([name, platform, *(f"{d}{v}" for d, v in sizes.items())])
                bytecode = module.mlir_module_serialized
                if bytecode not in written:
                    written[bytecode] = stem
                    (tmp / "static" / f"{stem}.mlir").write_text(module.mlir_module())
                    (tmp / "static" / f"{stem}.mlirbc").write_bytes(bytecode)
                entries.append(
                    {
                        "function": name,
                        "platform": platform,
                        "shape": sizes,
                        "text": f"static/{written[bytecode]}.mlir",
                        "bytecode": f"static/{written[bytecode]}.mlirbc",
                        # jax.export drops the inputs a function never reads (an encoder's
                        # init_cache reads none): the module takes these of `inputs`.
                        "kept_inputs": sorted(module.module_kept_var_idx),
                    }
                )
    return entries, all(stripped)


def write_runner(tmp: pathlib.Path) -> dict[str, Any]:
    """Write the C runner and the PJRT C API header it builds against (XLA's, Apache-2.0, as
    the `xla-cpu-pjrt` wheel ships it) into the artifact; the manifest's `pjrt` entry: the
    header's API version, which the runner requires of a plugin (the same major version, warning
    on an older minor), and the PJRT plugin wheels installed beside the export."""
    here = pathlib.Path(__file__).parent
    header = (here / standalone.PJRT_HEADER).read_text()
    (tmp / standalone.RUNNER_SOURCE).write_bytes((here / standalone.RUNNER_SOURCE).read_bytes())
    (tmp / standalone.PJRT_HEADER).write_text(header)
    version = [
        int(re.search(rf"#define PJRT_API_{part} (\d+)", header).group(1))  # type: ignore[union-attr]
        for part in ("MAJOR", "MINOR")
    ]
    plugins = {}
    for name in ("xla-cpu-pjrt", "xla-cuda12-pjrt", "xla-cuda13-pjrt"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            plugins[name] = importlib.metadata.version(name)
    return {
        "runner": standalone.RUNNER_SOURCE,
        "header": standalone.PJRT_HEADER,
        "api_version": version,
        "plugins": plugins,
        "usage": "cc -O2 -std=c11 -I. runner.c -ldl -lm -o runner && ./runner . --plugin "
        "PLUGIN.so (or: python run.py . --pjrt; dense-armor runner DIR)",
    }
