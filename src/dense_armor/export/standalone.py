"""Load and check a dense_armor artifact directory with jax, numpy and safetensors only.

This file imports nothing from dense_armor: the export stage copies it into every artifact
directory as `run.py`, so a deployment can run

    python run.py ARTIFACT_DIR [--steps N]

to verify every file's sha256, run the golden inputs through the exported forward and a stream
through the exported `init_cache`, `prefill`, `step` and `reset` (the first `N` steps), and print
the largest error against the outputs of the Python model. An `N` past the golden stream repeats
its last input: each step past it is checked against the overflow contract (a stream past the
capacity is flagged, its outputs NaN, its fixed cache unchanged), and the line says from which
step each stream overflowed. `load(ARTIFACT_DIR)` returns an
`Artifact` with `forward`, `init_cache`, `step`, `prefill` and `reset`.

    python run.py ARTIFACT_DIR --iree

runs the IREE-compiled static modules (`dense-armor compile`) on their golden cases in IREE's
runtime (`--device local-sync` for IREE's single-thread device), instead: the forward,
`init_cache`, `prefill`, `reset` and a stream of steps with the cache fed back (`--steps N` as
above). That needs numpy, safetensors and the `iree-base-runtime` wheel, not jax: its Python
runtime runs the modules in this process, or with `--iree-runner iree-run-module` IREE's own
tool does, a process per call (what IREE's tools alone, without Python, run).

    python run.py ARTIFACT_DIR --pjrt [--plugin PLUGIN.so]

builds the artifact's C runner (`runner.c`, with the system C compiler) and runs the same golden
cases from C through a PJRT plugin (default: the installed `xla-cpu-pjrt` wheel's), the weights and
the cache staying on the device; no Python runs in that process.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
from safetensors.numpy import load_file

try:
    import jax
    from jax import export
except ImportError:  # `--iree` needs no jax
    jax = None  # type: ignore[assignment]

FORMAT = "dense_armor.export"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"


class ArtifactError(ValueError):
    """A missing, corrupt, tampered or foreign artifact file, or a bad call to a loaded function."""


def sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkers_tolerance(manifest: dict[str, Any], platform: str) -> float:
    """The tolerance a check on `platform` ("cpu", "tpu", "cuda", ...) holds the artifact to:
    `precision.tolerance` on a CPU, `precision.accelerator_tolerance` elsewhere (an
    accelerator's float32 transcendentals are approximations; the manifest says by how much).
    Tokens are compared exactly on every platform."""
    precision = manifest["precision"]
    if platform == "cpu":
        return float(precision["tolerance"])
    return float(precision.get("accelerator_tolerance", precision["tolerance"]))


def read_manifest(directory: pathlib.Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST}: not a dense_armor artifact directory.")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"corrupt {path}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a dense_armor export manifest.")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format version {manifest.get('format_version')!r}; this loader reads "
            f"version {FORMAT_VERSION}: export the model again with this dense_armor (version 1 "
            "artifacts had no exported init_cache, prefill or reset)."
        )
    _require(manifest, REQUIRED, path, "")
    _require(manifest["weights"], ("file", "names"), path, "weights.")
    _require(manifest["golden"], ("file", "forward", "stream", "static"), path, "golden.")
    _require(manifest["streaming"], ("capacity", "layout"), path, "streaming.")
    for name, function in manifest["functions"].items():
        _require(function, ("file", "inputs", "outputs"), path, f"functions.{name}.")
    for name, entry in manifest["files"].items():
        _require(entry, ("sha256", "bytes"), path, f"files[{name!r}].")
    for i, entry in enumerate(manifest["static"]):
        _require(entry, ("function", "shape", "bytecode", "kept_inputs"), path, f"static[{i}].")
    _check_mesh_entry(manifest.get("mesh"), path)
    return manifest


def _check_mesh_entry(mesh: Any, path: pathlib.Path) -> None:
    """A laid-out artifact's `mesh`: `axes`, each a positive count of devices, and `devices`,
    their product (absent: one device)."""
    if mesh is None:
        return
    axes = mesh.get("axes") if isinstance(mesh, dict) else None
    devices = mesh.get("devices") if isinstance(mesh, dict) else None
    axes = axes if isinstance(axes, dict) else {}
    counts = list(axes.values())
    if not (
        counts
        and all(isinstance(name, str) for name in axes)
        and all(_is_integer(n) and n >= 1 for n in counts)
        and _is_integer(devices)
        and devices == int(np.prod(counts))
    ):
        raise ArtifactError(
            f"{path}: `mesh` must give `axes` (each a positive count of devices) and `devices`, "
            f"their product; received {mesh!r} (edited?)."
        )


# The manifest's keys a loader reads; a manifest without one of them is refused by name.
REQUIRED = (
    "weights",
    "functions",
    "files",
    "golden",
    "streaming",
    "static",
    "versions",
    "compatibility",
)


def _require(mapping: Any, keys: Sequence[str], path: pathlib.Path, where: str) -> None:
    if not isinstance(mapping, dict):
        raise ArtifactError(f"{path}: `{where.rstrip('.') or 'manifest'}` is not an object.")
    for key in keys:
        if key not in mapping:
            raise ArtifactError(f"{path} lacks the key `{where}{key}`: edited or truncated.")


def file_table(directory: pathlib.Path) -> dict[str, dict[str, Any]]:
    """`{relative path: {"sha256", "bytes"}}` of every file under `directory` but the manifest."""
    return {
        str(path.relative_to(directory)): {"sha256": sha256(path), "bytes": path.stat().st_size}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def verify_files(directory: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Check that every file the manifest lists exists with its size and sha256."""
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"missing artifact file: {path}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(
                f"{path} has {size} bytes; the manifest says {entry['bytes']} "
                "(truncated or replaced)."
            )
        if sha256(path) != entry["sha256"]:
            raise ArtifactError(f"{path} does not match its sha256 in the manifest (corrupted).")


def _load_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises several types for a bad header
        raise ArtifactError(f"unreadable safetensors file {path}: {error}") from None


class Artifact:
    """The exported functions of one artifact directory, with the weights bound.

    - `forward(*inputs)`: an encoder's `forward(x)` maps `x (B, T, n_in) -> y (B, n_out)`; a
      decoder's `forward(x, context, context_mask)` maps to `y (B, T, n_out)`. Any `B`,
      `1 <= T <= max_len`.
    - `init_cache(streams)` (an encoder: `streams` is `B` or a boolean vector of `B` entries),
      `init_cache(context, context_mask=None)` (a decoder: the context projected once): the
      cache of `B` new streams, a list of arrays (the manifest's `streaming.layout`).
    - `step(x_t, cache) -> (y_t, cache, overflow)`: `x_t (B, n_in)`; `overflow (B,)` is true where
      a stream has outrun the cache's capacity, and its `y_t` row is NaN.
    - `prefill(x, cache) -> (y, cache, overflow)`: `x (B, T, n_in)`, any `T`: what `T` calls of
      `step` return, stacked on axis 1, in one call.
    - `reset(cache, streams, *context) -> cache`: the streams where `streams (B,)` is true start
      again (a decoder's with their rows of the new `context, context_mask`); the others are
      untouched.
    - `call(name, *inputs)`: any exported function by its manifest name, inputs checked.

    The cache passed to `step`, `prefill` and `reset` is donated: use the one they return.
    """

    def __init__(self, directory: str | pathlib.Path, verify: bool = True):
        if not isinstance(verify, bool):  # "false" would verify; a string is a mistake
            raise ArtifactError(
                f"load: `verify` must be True or False; received `verify={verify!r}` "
                f"({type(verify).__name__})."
            )
        self.directory = pathlib.Path(directory)
        previous = self.directory.with_name(self.directory.name + ".previous")
        if not self.directory.exists() and previous.is_dir():
            self.directory = previous  # a replacement was interrupted between its two renames
        self.manifest = read_manifest(self.directory)
        self.kind = self.manifest.get("kind")
        if verify:
            verify_files(self.directory, self.manifest)
        weights = _load_safetensors(self.directory / self.manifest["weights"]["file"])
        names = self.manifest["weights"]["names"]
        missing = [n for n in names if n not in weights]
        if missing:
            raise ArtifactError(f"the weights file lacks {missing[:3]}.")
        if jax is None:
            raise ArtifactError("loading an artifact's functions needs jax (pip install jax).")
        self.mesh, self._unplaced = None, None
        self.weights = [weights[n] for n in names]  # on the host until placed below
        try:  # without the devices of its mesh, an artifact loads (to inspect) but cannot run
            self.mesh = _artifact_mesh(self.manifest)
        except ArtifactError as error:
            self._unplaced = error
        self.platform = jax.default_backend() if self.mesh is None else _platform(self.mesh)
        self.functions = {}
        self._calls = {}
        for name, spec in self.manifest["functions"].items():
            blob = (self.directory / spec["file"]).read_bytes()
            try:
                self.functions[name] = export.deserialize(bytearray(blob))
            except Exception as error:
                raise ArtifactError(f"cannot deserialize {spec['file']}: {error}") from None
            self._cross_check(name, self.functions[name], weights)
            n_plain = len([i for i in self.inputs(name) if i["role"] != "cache"])
            # A donated cache (the argument after the plain inputs) is updated in place.
            self._calls[name] = jax.jit(
                self.functions[name].call,
                donate_argnums=(1 + n_plain,) if spec.get("donated") else (),
                **_laid_out(self.functions[name], self.mesh),
            )
        if self._unplaced is None:
            self.weights = _placed(self.weights, self.functions["forward"], self.mesh)

    def _cross_check(self, name: str, exported: Any, weights: dict[str, np.ndarray]) -> None:
        """The manifest must say what the module and the weights file hold: every input and
        output of `name` (shape, with symbolic dimensions by name, and dtype), and every weight."""
        spec = self.manifest["functions"][name]
        devices = (self.manifest.get("mesh") or {}).get("devices", 1)
        if exported.nr_devices != devices:
            raise ArtifactError(
                f"{name}: the manifest says its modules run on {devices} device(s); the exported "
                f"module was laid out for {exported.nr_devices} (manifest edited?)."
            )
        for side, specs, avals in (
            ("input", spec["inputs"], exported.in_avals),
            ("output", spec["outputs"], exported.out_avals),
        ):
            if len(specs) != len(avals):
                raise ArtifactError(
                    f"{name}: the manifest lists {len(specs)} {side}s; the exported module has "
                    f"{len(avals)}."
                )
            for s, aval in zip(specs, avals, strict=True):
                shape = [d if isinstance(d, int) else str(d) for d in aval.shape]
                if shape != list(s["shape"]) or str(aval.dtype) != s["dtype"]:
                    raise ArtifactError(
                        f"{name}: the manifest says {side} {s['name']!r} has shape "
                        f"{tuple(s['shape'])} and dtype {s['dtype']}; the exported module has "
                        f"{tuple(shape)} and {aval.dtype}."
                    )
            if side == "input":
                for s in specs:
                    if s["role"] != "weight":
                        continue
                    array = weights[s["name"]]
                    if list(array.shape) != list(s["shape"]) or str(array.dtype) != s["dtype"]:
                        raise ArtifactError(
                            f"the weights file holds {s['name']!r} with shape {array.shape} and "
                            f"dtype {array.dtype}; the manifest and the module say "
                            f"{tuple(s['shape'])} and {s['dtype']}."
                        )

    def inputs(self, function: str, role: str | None = None) -> list[dict[str, Any]]:
        """The manifest's non-weight inputs of `function` (of one `role` if given)."""
        return [
            i
            for i in self.manifest["functions"][function]["inputs"]
            if i["role"] != "weight" and (role is None or i["role"] == role)
        ]

    def _check(self, function: str, arrays: Sequence[Any]) -> dict[str, int]:
        """Check `arrays` against the manifest's inputs of `function`; return the dim sizes."""
        specs = self.inputs(function)
        if len(arrays) != len(specs):
            names = [s["name"] for s in specs]
            raise ArtifactError(
                f"{function}: expected {len(specs)} inputs ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}); received {len(arrays)}."
            )
        sizes: dict[str, int] = {}
        for spec, array in zip(specs, arrays, strict=True):
            shape = tuple(np.shape(array))
            dtype = array.dtype if hasattr(array, "dtype") else np.asarray(array).dtype
            ok = len(shape) == len(spec["shape"]) and str(dtype) == spec["dtype"]
            for dim, size in zip(spec["shape"], shape, strict=False):
                if isinstance(dim, str):
                    if sizes.setdefault(dim, size) != size:
                        raise ArtifactError(
                            f"{function}: input {spec['name']!r} has {dim}={size}, but an earlier "
                            f"input has {dim}={sizes[dim]}."
                        )
                else:
                    ok = ok and dim == size
            if not ok:
                raise ArtifactError(
                    f"{function}: input {spec['name']!r} must have shape "
                    f"{tuple(spec['shape'])} and dtype {spec['dtype']}; received shape {shape} "
                    f"and dtype {dtype}."
                )
        for dim, (low, high) in self.manifest["functions"][function].get("bounds", {}).items():
            if dim in sizes and not low <= sizes[dim] <= high:
                raise ArtifactError(
                    f"{function}: {dim}={sizes[dim]} is outside the exported range [{low}, {high}]."
                )
        return sizes

    def call(self, function: str, *inputs: Any) -> Any:
        if function not in self._calls:
            raise ArtifactError(f"this artifact has no function {function!r}.")
        if self._unplaced is not None:
            raise self._unplaced
        self._check(function, inputs)
        specs = self.inputs(function)
        plain = [x for x, s in zip(inputs, specs, strict=True) if s["role"] != "cache"]
        cache = [x for x, s in zip(inputs, specs, strict=True) if s["role"] == "cache"]
        return self._calls[function](self.weights, *plain, *([list(cache)] if cache else []))

    def forward(self, *inputs: Any) -> jax.Array:
        return self.call("forward", *inputs)

    def init_cache(self, *inputs: Any, context_mask: Any = None) -> list[jax.Array]:
        specs = self.inputs("init_cache")
        if [i["role"] for i in specs] == ["streams"] and len(inputs) == 1:
            (streams,) = inputs
            if _is_integer(streams):
                if streams < 1:
                    raise ArtifactError(
                        f"init_cache: the number of streams must be positive; received {streams}."
                    )
                streams = np.ones(streams, bool)
            inputs = (streams,)
        elif [i["name"] for i in specs] == ["context", "context_mask"] and len(inputs) == 1:
            (context,) = inputs
            if context_mask is None:
                context_mask = np.ones(np.shape(context)[:2], bool)
            inputs = (context, context_mask)
        return list(self.call("init_cache", *inputs))

    def step(self, x_t: Any, cache: Sequence[Any]) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        y_t, new_cache, overflow = self.call("step", x_t, *_cache_list("step", cache))
        return y_t, list(new_cache), overflow

    def prefill(self, x: Any, cache: Sequence[Any]) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        y, new_cache, overflow = self.call("prefill", x, *_cache_list("prefill", cache))
        return y, list(new_cache), overflow

    def reset(self, cache: Sequence[Any], streams: Any, *context: Any) -> list[jax.Array]:
        return list(self.call("reset", streams, *context, *_cache_list("reset", cache)))

    def sample_prefill(
        self, x: Any, cache: Sequence[Any], key: Any = None
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        """A language model's prompts `x (B, T)` and each stream's first new token `(B,)`, drawn
        in the graph with the manifest's `sampling` rules and `key` (a raw `uint32[2]` PRNG key;
        default `[0, 0]`, all greedy decoding needs)."""
        token, new_cache, overflow = self.call(
            "sample_prefill", x, _raw_key(key), *_cache_list("sample_prefill", cache)
        )
        return token, list(new_cache), overflow

    def sample_step(
        self, x_t: Any, cache: Sequence[Any], key: Any = None
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        """One token per stream in, `x_t (B,)`, and the next out, as `sample_prefill`."""
        token, new_cache, overflow = self.call(
            "sample_step", x_t, _raw_key(key), *_cache_list("sample_step", cache)
        )
        return token, list(new_cache), overflow


def _raw_key(key: Any) -> Any:
    """`key`, or the zero key for greedy decoding (which does not read it)."""
    return np.zeros(2, np.uint32) if key is None else key


def _cache_list(function: str, cache: Any) -> Sequence[Any]:
    if isinstance(cache, str | bytes) or not isinstance(cache, Sequence):
        raise ArtifactError(
            f"{function}: `cache` must be the list of arrays that `init_cache` (or the previous "
            f"call) returned; received {type(cache).__name__}."
        )
    return cache


def _artifact_mesh(manifest: dict[str, Any]) -> Any:
    """The mesh a laid-out artifact runs on (None for one device): the manifest's `mesh.axes`
    over the first devices of JAX's default backend, or of the CPU where the default has fewer
    (`main` simulates them there: `--xla_force_host_platform_device_count`)."""
    axes = (manifest.get("mesh") or {}).get("axes")
    if not axes:
        return None
    count = int(np.prod(list(axes.values())))
    devices = jax.devices()
    if len(devices) < count:
        devices = jax.devices("cpu")
    if len(devices) < count:
        raise ArtifactError(
            f"this artifact's modules are laid out for {count} devices (mesh {axes}); this "
            f"process's jax has {len(jax.devices())} {jax.default_backend()} device(s) and "
            f"{len(jax.devices('cpu'))} CPU device(s). Run `python run.py DIRECTORY`, which "
            f"simulates them on the CPU, or start jax with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}."
        )
    grid = np.array(devices[:count], dtype=object).reshape(tuple(axes.values()))
    return jax.sharding.Mesh(grid, tuple(axes))


def _platform(mesh: Any) -> str:
    return str(mesh.devices.flat[0].platform)


def _laid_out(exported: Any, mesh: Any) -> dict[str, Any]:
    """`jax.jit`'s shardings for a laid-out module's call on `mesh` (none for one device)."""
    if mesh is None:
        return {}
    (args, _) = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_shardings_jax(mesh))
    outputs = jax.tree_util.tree_unflatten(exported.out_tree, exported.out_shardings_jax(mesh))
    return {"in_shardings": args, "out_shardings": outputs}


def _placed(weights: list[np.ndarray], exported: Any, mesh: Any) -> list[Any]:
    """The weights on the device, or split over `mesh` as the module's first input says."""
    if mesh is None:
        return [jax.numpy.asarray(w) for w in weights]
    shardings = exported.in_shardings_jax(mesh)[: len(weights)]
    return [jax.device_put(w, where) for w, where in zip(weights, shardings, strict=True)]


def require_one_device(manifest: dict[str, Any], what: str) -> None:
    """An `ArtifactError` naming `what` for an artifact laid out over several devices: its
    static modules run on that many devices at once, which `what` does not."""
    count = (manifest.get("mesh") or {}).get("devices", 1)
    if count > 1:
        raise ArtifactError(
            f"this artifact's modules are laid out for {count} devices "
            f"(mesh {manifest['mesh'].get('axes')}); {what} runs one device's modules. Check it "
            "with `python run.py DIRECTORY` (jax, the devices simulated on the CPU where "
            "there are fewer), or export the model without a mesh for this runtime."
        )


def simulate_devices(directory: str | pathlib.Path) -> None:
    """Before jax starts: as many CPU devices as a laid-out artifact's mesh has (only where
    `XLA_FLAGS` names no count), so that a machine with fewer devices checks it on its CPU."""
    try:
        count = (read_manifest(pathlib.Path(directory)).get("mesh") or {}).get("devices", 1)
    except ArtifactError:
        return  # reported when the artifact loads
    flags = os.environ.get("XLA_FLAGS", "")
    if isinstance(count, int) and count > 1 and "host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def load(directory: str | pathlib.Path, verify: bool = True) -> Artifact:
    """Load an artifact directory, verifying the sha256 of every file unless `verify=False`."""
    return Artifact(directory, verify=verify)


def _error(a: Any, b: Any) -> float:
    """The largest absolute difference; NaN where both are NaN counts as equal (a stream past its
    capacity), NaN on one side only as infinite. An int8 array (a quantized cache's rows) counts
    in units of its range, a level being 1/127: a row rounded the other way at a half is one."""
    levels = 127.0 if np.asarray(a).dtype == np.int8 else 1.0
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    both = np.isnan(a) & np.isnan(b)
    diff = np.where(both, 0.0, np.abs(a - b)) / levels
    return float(np.where(np.isnan(diff), np.inf, diff).max(initial=0.0))


def _is_integer(value: Any) -> bool:
    """A Python or NumPy integer, never a bool (this file's copy of the package's predicate: it
    imports nothing from dense_armor)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_steps(steps: Any) -> None:
    if steps is not None and (not _is_integer(steps) or steps < 1):
        raise ArtifactError(
            f"`steps` must be a positive integer (the golden steps to run) or None for all; "
            f"received {steps!r}."
        )


def check_golden(artifact: Artifact, steps: int | None = None) -> dict[str, float]:
    """Run the golden inputs through every exported function; return the largest absolute errors.

    The stream: `init_cache`, `prefill` over its first steps, then `step` over the rest (the first
    `steps` in all), with stream 1 reset part-way; the golden outputs were computed one stream at
    a time from its own empty cache."""
    _check_steps(steps)
    golden = _load_safetensors(artifact.directory / artifact.manifest["golden"]["file"])
    errors = {}
    for case in artifact.manifest["golden"]["forward"]:
        y = artifact.forward(*(golden[k] for k in case["inputs"]))
        errors[f"forward B={case['B']} T={case['T']}"] = _error(y, golden[case["output"]])
    plan = artifact.manifest["golden"]["stream"]
    xs, ys = golden[plan["x"]], golden[plan["y"]]
    total = xs.shape[1] if steps is None else steps
    n = min(total, xs.shape[1])
    cache = artifact.call("init_cache", *(golden[k] for k in plan["init_cache"]["inputs"]))
    errors["init_cache"] = max(
        (_error(a, golden[k]) for a, k in zip(cache, plan["init_cache"]["outputs"], strict=True)),
        default=0.0,
    )
    k = min(plan["prefill"], n)
    y, cache, overflow = artifact.prefill(xs[:, :k], list(cache))
    worst = {"prefill": _error(y, ys[:, :k]), "step": 0.0, "reset": 0.0}
    for t in range(k, n):
        if bool(np.any(overflow)):
            raise ArtifactError(f"step {t}: the cache overflowed within its capacity.")
        if t == plan["reset_at"]:
            cache = artifact.reset(cache, *(golden[key] for key in plan["reset"]["inputs"]))
        y_t, cache, overflow = artifact.step(xs[:, t], cache)
        worst["step"] = max(worst["step"], _error(y_t[0], ys[0, t]))
        after = "reset" if t >= plan["reset_at"] else "step"
        worst[after] = max(worst[after], _error(y_t[1], ys[1, t]))
    if bool(np.any(overflow)):
        raise ArtifactError("the cache overflowed within its capacity.")
    b = xs.shape[0]
    if "generation" in artifact.manifest["golden"]:
        errors.update(_check_generation(artifact, golden, steps))
    errors[f"prefill B={b} T={k}"] = worst["prefill"]
    errors[f"step B={b}, {n - k} steps"] = worst["step"]
    if k <= plan["reset_at"] < n:
        errors[f"reset at step {plan['reset_at']}"] = worst["reset"]
    if total > n:
        errors.update(_steps_past_the_golden(artifact, xs[:, -1], cache, overflow, n, total))
    return errors


def _steps_past_the_golden(
    artifact: Artifact, x_t: Any, cache: Any, overflow: Any, done: int, total: int
) -> dict[str, float]:
    """Steps `done + 1 .. total` of the golden stream, its last input repeated: the streams that
    break the overflow contract (`_past_the_golden`)."""
    fixed = _fixed_cache(artifact.manifest, artifact.manifest["functions"]["step"])
    broken, flagged = 0, dict[int, int]()  # stream -> the step its flag was first set
    for t in range(done, total):
        before = [np.array(a) for a in cache]  # the step donates the cache
        y_t, new, flags = artifact.step(x_t, cache)
        broken += _past_the_golden(y_t, before, new, overflow, flags, fixed, tokens=False)
        for b in np.flatnonzero(np.asarray(flags)):
            flagged.setdefault(int(b), t + 1)
        cache, overflow = new, flags
    b = np.asarray(x_t).shape[0]
    return {_past_label(f"step B={b}", total - done, done, flagged): float(broken)}


def _runner() -> str:
    beside = pathlib.Path(sys.executable).parent / "iree-run-module"  # a venv not on PATH
    found = shutil.which("iree-run-module") or str(beside)
    if not pathlib.Path(found).is_file():
        raise ArtifactError(
            "iree-run-module not found: pip install iree-base-runtime (or put IREE's tools on "
            "PATH)."
        )
    return found


def run_iree(
    runner: str,
    module: pathlib.Path,
    inputs: Sequence[np.ndarray | pathlib.Path],
    outputs: Sequence[dict[str, Any]],
    sizes: dict[str, int],
    work: pathlib.Path,
    device: str = "local-task",
) -> list[np.ndarray]:
    """`main` of a compiled module on the local CPU through `iree-run-module` (on IREE's
    `device`), inputs and outputs passed as files (`outputs`: the manifest's output specs, their
    dimensions named in `sizes`); an input given as a path is an .npy file already written (the
    weights, the same for every call of a check: `_saved`). A bfloat16 output, which .npy cannot
    hold, comes back as raw bytes, widened to float32."""
    args = [runner, f"--device={device}", f"--module={module}", "--function=main"]
    for i, array in enumerate(inputs):
        written = array if isinstance(array, pathlib.Path) else _npy(work / f"in{i}.npy", array)
        args.append(f"--input=@{written}")
    files = [
        work / f"out{i}.{'bin' if spec['dtype'] == 'bfloat16' else 'npy'}"
        for i, spec in enumerate(outputs)
    ]
    args += [f"--output=@{file}" for file in files]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise ArtifactError(f"iree-run-module failed on {module.name}: {done.stderr.strip()[:800]}")
    results = []
    for file, spec in zip(files, outputs, strict=True):
        if file.suffix == ".bin":
            shape = tuple(sizes.get(d, -1) if isinstance(d, str) else d for d in spec["shape"])
            bits = np.fromfile(file, np.uint16).astype(np.uint32) << 16
            try:
                results.append(bits.view(np.float32).reshape(shape))
            except ValueError:
                raise ArtifactError(
                    f"{module.name}: output {spec['name']!r} holds {bits.size} values, not the "
                    f"shape {tuple(spec['shape'])} that the manifest gives it (manifest edited?)."
                ) from None
        else:
            results.append(np.load(file))
    return results


def _npy(path: pathlib.Path, array: np.ndarray) -> pathlib.Path:
    """`array` written to `path` as .npy (C order, as `iree-run-module` reads it)."""
    np.save(path, np.ascontiguousarray(array))
    return path


def _saved(arrays: Sequence[np.ndarray], work: pathlib.Path) -> list[pathlib.Path]:
    """Each of `arrays` written once as `work/w<i>.npy`, for `run_iree` to pass by name: a
    stream's steps then write only their cache (Qwen3.5's check of 42 calls wrote 5,494 files,
    1.6 s of its 5.4)."""
    return [_npy(work / f"w{i}.npy", array) for i, array in enumerate(arrays)]


IREE_DEVICES = ("local-task", "local-sync")
IREE_RUNNERS = ("auto", "python", "iree-run-module")


class _Tool:
    """IREE's own runner, `iree-run-module`: a process per call, inputs and outputs through .npy
    files in `work` (the weights written once, `keep`)."""

    def __init__(self, device: str, work: pathlib.Path):
        self.path, self.device, self.work = _runner(), device, work
        self.name = f"iree-run-module ({device})"

    def keep(self, arrays: Sequence[np.ndarray]) -> list[pathlib.Path]:
        return _saved(arrays, self.work)

    def __call__(
        self, module: pathlib.Path, inputs: Sequence[Any], outputs: Sequence[dict[str, Any]],
        sizes: dict[str, int],
    ) -> list[np.ndarray]:  # fmt: skip
        return run_iree(self.path, module, inputs, outputs, sizes, self.work, self.device)


class _Bindings:
    """IREE's runtime in this process (`iree.runtime`, the Python bindings of the same
    `iree-base-runtime` wheel): each module loaded once per check and called with arrays, no
    file and no process per call (a call of a tiny model's step about 1 ms, against 80 for
    `iree-run-module`'s process and device start)."""

    def __init__(self, device: str):
        import iree.runtime as runtime

        self.runtime, self.config = runtime, runtime.Config(device)
        self.name = f"IREE's Python runtime ({device})"
        self.loaded: dict[pathlib.Path, tuple[Any, Any]] = {}  # a module's context and `main`

    def keep(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        return list(arrays)

    def _main(self, module: pathlib.Path) -> Any:
        if module not in self.loaded:
            vm = self.runtime.VmModule.mmap(self.config.vm_instance, str(module))
            context = self.runtime.SystemContext(vm_modules=[vm], config=self.config)
            self.loaded[module] = (context, getattr(context.modules, vm.name)["main"])
        return self.loaded[module][1]

    def __call__(
        self, module: pathlib.Path, inputs: Sequence[Any], outputs: Sequence[dict[str, Any]],
        sizes: dict[str, int],
    ) -> list[np.ndarray]:  # fmt: skip
        try:
            got = self._main(module)(*inputs)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ArtifactError(f"IREE's runtime failed on {module.name}: {error}") from None
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        if len(got) != len(outputs):
            raise ArtifactError(
                f"{module.name} returns {len(got)} outputs; the manifest lists {len(outputs)} "
                "(manifest edited?)."
            )
        return [np.asarray(array.to_host()) for array in got]


def _check_runner(runner: Any, device: Any) -> None:
    if runner not in IREE_RUNNERS:
        raise ArtifactError(f"`runner` must be one of {IREE_RUNNERS}; received {runner!r}.")
    if device not in IREE_DEVICES:
        raise ArtifactError(f"`device` must be one of {IREE_DEVICES}; received {device!r}.")


def iree_runner(runner: str, device: str, work: pathlib.Path) -> _Tool | _Bindings:
    """`runner`: `python` (IREE's runtime in this process), `iree-run-module` (IREE's tool, a
    process per call: what a deployment without Python runs), or `auto`, the first where
    `iree.runtime` can be imported."""
    _check_runner(runner, device)
    try:
        bindings = importlib.util.find_spec("iree.runtime") is not None
    except ImportError:  # no `iree` package at all
        bindings = False
    if runner == "python" or (runner == "auto" and bindings):
        if not bindings:
            raise ArtifactError("IREE's Python runtime is not installed: pip install "
                                "iree-base-runtime.")  # fmt: skip
        return _Bindings(device)
    return _Tool(device, work)


def _run_kept(
    runner: _Tool | _Bindings,
    module: pathlib.Path,
    kept: Sequence[int],
    outputs: Sequence[dict[str, Any]],
    sizes: dict[str, int],
    every: Sequence[Any],
) -> list[np.ndarray]:
    """`runner` on the inputs of `every` (weights, plain inputs, cache) that the module kept."""
    return runner(module, [every[i] for i in kept], outputs, sizes)


# StableHLO's element types, by the names the manifest gives them.
MLIR_DTYPES = {
    "f64": "float64",
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "i1": "bool",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "ui8": "uint8",
    "ui32": "uint32",
}


def _tensor_type(text: str) -> tuple[list[int], str]:
    """`1x2x6x4xf32` -> ([1, 2, 6, 4], "float32"); `i1` -> ([], "bool")."""
    *dims, element = text.split("x")
    return [int(d) if d.isdigit() else -1 for d in dims], MLIR_DTYPES.get(element, element)


def module_signature(text: str) -> tuple[list[tuple[list[int], str]], list[tuple[list[int], str]]]:
    """The (shape, dtype) of each argument and result of a static module's `@main`, read from
    its StableHLO text."""
    found = re.search(r"func\.func public @main\((.*?)\) -> (.*?)\{?\s*$", text, re.M)
    if found is None:
        raise ArtifactError("a static module has no `func.func public @main`: not jax's export.")
    arguments = re.findall(r"%arg\d+: tensor<([^>]*)>", found.group(1))
    results = re.findall(r"tensor<([^>]*)>", found.group(2))
    return [_tensor_type(a) for a in arguments], [_tensor_type(r) for r in results]


def check_static_signature(
    directory: pathlib.Path, manifest: dict[str, Any], entry: dict[str, Any]
) -> None:
    """The manifest must say what a static module takes and returns: each kept input and each
    output (shape, its named dimensions at the module's sizes, and dtype), as in the module's own
    StableHLO text (what `Artifact` checks against the exported module on the JAX path)."""
    function = manifest["functions"][entry["function"]]
    sizes, where = entry["shape"], f"{entry['text']} ({entry['function']} {entry['shape']})"
    arguments, results = module_signature((directory / entry["text"]).read_text())
    kept = [function["inputs"][i] for i in entry["kept_inputs"] if i < len(function["inputs"])]
    for side, specs, types in (
        ("input", kept, arguments),
        ("output", function["outputs"], results),
    ):
        if len(specs) != len(types) or len(kept) != len(entry["kept_inputs"]):
            raise ArtifactError(
                f"{where}: the manifest lists {len(specs)} {side}s of this module; the module "
                f"has {len(types)} (manifest edited?)."
            )
        for spec, (shape, dtype) in zip(specs, types, strict=True):
            claimed = [sizes.get(d, d) if isinstance(d, str) else d for d in spec["shape"]]
            if claimed != shape or spec["dtype"] != dtype:
                raise ArtifactError(
                    f"{where}: the manifest says {side} {spec['name']!r} has shape "
                    f"{tuple(claimed)} and dtype {spec['dtype']}; the module has {tuple(shape)} "
                    f"and {dtype} (manifest edited?)."
                )


def _check_generation(
    artifact: Artifact, golden: dict[str, np.ndarray], steps: int | None
) -> dict[str, float]:
    """A language model's decoding, the sampling in the graph: `sample_prefill` on the golden
    prompts, then `sample_step` on each token it returns (the first `steps` tokens); the error is
    the number of tokens that differ from the Python model's."""
    plan = artifact.manifest["golden"]["generation"]
    prompts, key, want = (golden[plan[k]] for k in ("prompt", "key", "tokens"))
    n = want.shape[1] if steps is None else max(1, min(steps, want.shape[1]))
    cache = artifact.init_cache(prompts.shape[0])
    token, cache, overflow = artifact.sample_prefill(prompts, cache, key)
    got = [np.asarray(token)]
    for _ in range(n - 1):
        token, cache, overflow = artifact.sample_step(token, cache, key)
        got.append(np.asarray(token))
    if bool(np.any(overflow)):
        raise ArtifactError("decoding: the cache overflowed within its capacity.")
    wrong = int((np.stack(got, axis=1) != want[:, :n]).sum())
    return {f"decode B={prompts.shape[0]}, {n} tokens (tokens that differ)": float(wrong)}


def check_iree(
    directory: str | pathlib.Path,
    steps: int | None = None,
    device: str = "local-task",
    runner: str = "auto",
) -> dict[str, float]:
    """Run every `llvm-cpu` module of the artifact on its golden case in IREE (on IREE's
    `device`: `local-task`, its thread pool, or `local-sync`, the calling thread; with `runner`,
    see `iree_runner`) and return the largest absolute error of each against the Python model's
    outputs. A step case is a stream: `steps` (default all) calls, the cache fed back; past the
    golden stream its last input is repeated (a decoding feeds back its tokens) and
    `_past_the_golden` checks each call."""
    return check_iree_with(directory, steps, device, runner)[1]


def check_iree_with(
    directory: str | pathlib.Path, steps: int | None, device: str, runner: str
) -> tuple[str, dict[str, float]]:
    """`check_iree`, and the name of the runner that ran the modules."""
    _check_steps(steps)
    _check_runner(runner, device)
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    require_one_device(manifest, "IREE (--iree)")
    verify_files(directory, manifest)
    compiled = {
        c["module"]: c["file"] for c in manifest.get("compiled", []) if c["target"] == "llvm-cpu"
    }
    if not compiled:
        raise ArtifactError(
            f"{directory} has no IREE llvm-cpu modules: compile them first "
            f"(dense-armor compile {directory} --target llvm-cpu)."
        )
    for entry in manifest["static"]:  # a manifest that misdescribes a module: before any run
        if entry["bytecode"] in compiled:
            check_static_signature(directory, manifest, entry)
    stored = _load_safetensors(directory / manifest["weights"]["file"])
    weights = [stored[n] for n in manifest["weights"]["names"]]
    golden = _load_safetensors(directory / manifest["golden"]["file"])
    errors: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as work:
        run = iree_runner(runner, device, pathlib.Path(work))
        kept = run.keep(weights)  # once, not for each of a stream's calls
        for case in manifest["golden"]["static"]:
            entry = next(
                e
                for e in manifest["static"]
                if e["function"] == case["function"] and e["shape"] == case["shape"]
            )
            if entry["bytecode"] not in compiled:
                continue
            label = "iree " + " ".join(
                [case["function"], *(f"{d}={v}" for d, v in case["shape"].items())]
            )
            call = functools.partial(
                _run_kept,
                run,
                directory / compiled[entry["bytecode"]],
                entry["kept_inputs"],
                manifest["functions"][case["function"]]["outputs"],
                case["shape"],
            )
            inputs = [golden[k] for k in case["inputs"]]
            expected = [golden[k] for k in case["outputs"]]
            if case["steps"] is None:
                got = call([*kept, *inputs])
                errors[label] = max(_error(g, e) for g, e in zip(got, expected, strict=True))
            else:
                errors.update(
                    _iree_stream(manifest, case, call, kept, inputs, expected, label, steps)
                )
    return run.name, errors


def _iree_stream(
    manifest: dict[str, Any],
    case: dict[str, Any],
    call: Any,
    weights: Sequence[np.ndarray | pathlib.Path],
    inputs: list[np.ndarray],
    expected: list[np.ndarray],
    label: str,
    steps: int | None,
) -> dict[str, float]:
    """A golden step case run as a stream through `call`: its errors, and past the golden
    stream (`steps` beyond its length) what `_past_the_golden` finds."""
    function = manifest["functions"][case["function"]]
    roles = [i["role"] for i in function["inputs"]]
    plain = len([r for r in roles if r not in ("weight", "cache")])
    xs, rest, cache = inputs[0], inputs[1:plain], inputs[plain:]
    golden_steps = case["steps"]
    n = golden_steps if steps is None else steps
    worst, feedback, wrong, broken = 0.0, bool(case.get("feedback")), 0, 0
    flagged: dict[int, int] = {}  # stream -> the step its flag was first set
    fixed, was = _fixed_cache(manifest, function), np.zeros(xs.shape[0], bool)
    x_t = xs if feedback else xs[:, 0]
    for t in range(n):
        got = call([*weights, x_t, *rest, *cache])
        if t >= golden_steps:
            broken += _past_the_golden(got[0], cache, got[1:-1], was, got[-1], fixed, feedback)
            for b in np.flatnonzero(np.asarray(got[-1])):
                flagged.setdefault(int(b), t + 1)
        elif feedback:  # decoding: each step's token is the next one's input
            wrong += int(np.sum(np.asarray(got[0]) != expected[0][:, t]))
        else:
            worst = max(worst, _error(got[0], expected[0][:, t]))
        cache, was = got[1:-1], got[-1]
        x_t = got[0] if feedback else xs[:, min(t + 1, xs.shape[1] - 1)]
        if t == golden_steps - 1:  # the whole golden stream: its final cache and flags too
            worst = max(
                [worst] + [_error(g, e) for g, e in zip(got[1:], expected[1:], strict=True)]
            )
    shown = min(n, golden_steps)
    errors = {}
    if feedback:
        errors[f"{label}, {shown} tokens (tokens that differ)"] = float(wrong)
    errors[f"{label}, {shown} steps"] = worst
    if n > golden_steps:
        errors[_past_label(label, n - golden_steps, golden_steps, flagged)] = float(broken)
    return errors


def _fixed_cache(manifest: dict[str, Any], function: dict[str, Any]) -> list[bool]:
    """For each cache input of `function`: whether it belongs to a fixed key/value cache (its
    keys, values and counter), whose rows a stream past its capacity never writes."""
    holders = {e["path"]: e["holders"] for e in manifest["streaming"]["layout"]}
    cache = [i["name"] for i in function["inputs"] if i["role"] == "cache"]
    return [holders.get(name, [""])[0] == "FixedKVCache" for name in cache]


def _past_the_golden(
    y: Any,
    before: Sequence[Any],
    after: Sequence[Any],
    was: Any,
    overflow: Any,
    fixed: list[bool],
    tokens: bool,
) -> int:
    """How many streams of one call past the golden stream break the overflow contract (the
    manifest's `streaming.overflow`): a stream flagged `overflow` must have NaN outputs (a token
    is not a float: a decoding's are not checked), an unflagged one finite outputs, and a stream
    flagged before the call (`was`) its fixed cache unchanged, every array of it bit for bit."""
    flags, was = np.asarray(overflow).reshape(-1), np.asarray(was).reshape(-1)
    rows = np.asarray(y).reshape(flags.shape[0], -1)
    broken = 0
    for b, flag in enumerate(flags):
        wrong_rows = not np.isnan(rows[b]).all() if flag else not np.isfinite(rows[b]).all()
        rewritten = was[b] and any(
            not np.array_equal(np.asarray(old)[b], np.asarray(new)[b])
            for old, new, is_fixed in zip(before, after, fixed, strict=True)
            if is_fixed
        )
        broken += int((wrong_rows and not tokens) or rewritten)
    return broken


def _past_label(label: str, extra: int, golden_steps: int, flagged: dict[int, int]) -> str:
    where, items = [], sorted(flagged.items())
    while items:  # runs of neighbouring streams flagged at the same step: "streams 0-7 from step 9"
        run = 1
        while run < len(items) and items[run] == (items[0][0] + run, items[0][1]):
            run += 1
        (first, step), last = items[0], items[run - 1][0]
        where.append(
            f"stream{'s' if run > 1 else ''} {first}{f'-{last}' * (run > 1)} from step {step}"
        )
        items = items[run:]
    return (
        f"{label}, {extra} steps past the golden {golden_steps} (overflow: "
        f"{', '.join(where) or 'none'}; "
        "streams off contract)"
    )


# The C runner's source and the PJRT C API header it is built against, as the export copies them.
RUNNER_SOURCE = "runner.c"
PJRT_HEADER = "pjrt_c_api.h"
CPU_PLUGIN = "xla_plugins.xla_cpu_pjrt"  # the `xla-cpu-pjrt` wheel's package


def installed_cpu_plugin() -> pathlib.Path | None:
    """The directory of the installed `xla-cpu-pjrt` wheel's plugin (its `.so` and `include/`)."""
    try:
        spec = importlib.util.find_spec(CPU_PLUGIN)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def default_plugin() -> pathlib.Path:
    found = installed_cpu_plugin()
    if found is None or not (found / "xla_cpu_pjrt.so").is_file():
        raise ArtifactError(
            "no PJRT plugin given and the CPU plugin is not installed: pip install xla-cpu-pjrt "
            "(or 'dense-armor[pjrt]'), or pass --plugin PATH."
        )
    return found / "xla_cpu_pjrt.so"


def build_runner(
    directory: str | pathlib.Path, out: str | pathlib.Path, cc: str | None = None
) -> str:
    """Compile the artifact's `runner.c` against its own `pjrt_c_api.h` into the executable
    `out` with the system C compiler (`cc`, else $CC, else cc, gcc or clang on PATH); return the
    compiler's warnings (empty when none)."""
    directory = pathlib.Path(directory)
    source = directory / RUNNER_SOURCE
    for name in (RUNNER_SOURCE, PJRT_HEADER):
        if not (directory / name).is_file():
            raise ArtifactError(
                f"{directory} has no {name}: export the model again with this dense_armor."
            )
    include = directory
    compiler = (
        cc
        or os.environ.get("CC")
        or next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)
    )
    if compiler is None:
        raise ArtifactError("no C compiler found (cc, gcc or clang on PATH, or $CC).")
    command = [compiler, "-O2", "-std=c11", "-Wall", "-Wextra", f"-I{include}", str(source)]
    try:
        done = subprocess.run(
            [*command, "-o", str(out), "-ldl", "-lm"], capture_output=True, text=True
        )
    except OSError as error:
        raise ArtifactError(f"cannot run the C compiler {compiler}: {error}") from None
    if done.returncode != 0:
        raise ArtifactError(f"building {source} failed:\n{done.stderr.strip()[:2000]}")
    return done.stderr.strip()


def run_pjrt(
    directory: str | pathlib.Path,
    plugin: str | pathlib.Path | None = None,
    steps: int | None = None,
    repeat: int = 1,
    tolerance: float | None = None,
    cc: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Build the artifact's C runner and run it on the plugin (default: the installed
    `xla-cpu-pjrt`'s); its exit status, stdout and stderr (status 0: every golden case within the
    tolerance, 1: beyond it, 2: an unusable artifact or plugin, one `error:` line)."""
    _check_steps(steps)
    if not _is_integer(repeat) or repeat < 1:
        raise ArtifactError(f"`repeat` must be a positive integer; received {repeat!r}.")
    if tolerance is not None and not (
        isinstance(tolerance, int | float | np.integer | np.floating)
        and not isinstance(tolerance, bool | np.bool_)
        and 0 <= tolerance < float("inf")
    ):
        raise ArtifactError(
            f"`tolerance` must be a non-negative finite number or None; received {tolerance!r}."
        )
    if (pathlib.Path(directory) / MANIFEST).is_file():  # else the runner says what is missing
        require_one_device(read_manifest(pathlib.Path(directory)), "the C runner (--pjrt)")
    plugin = pathlib.Path(plugin) if plugin is not None else default_plugin()
    with tempfile.TemporaryDirectory() as work:
        runner = pathlib.Path(work) / "runner"
        build_runner(directory, runner, cc)
        command = [str(runner), str(directory), "--plugin", str(plugin), "--repeat", str(repeat)]
        command += ["--steps", str(steps)] if steps is not None else []
        command += ["--tolerance", repr(float(tolerance))] if tolerance is not None else []
        return subprocess.run(command, capture_output=True, text=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_flags(args)
        if not (args.pjrt or args.iree):
            simulate_devices(args.directory)
        if args.pjrt:
            return _from_c(args)
        if args.iree:
            runner, errors = check_iree_with(
                args.directory, args.steps, args.device or "local-task", args.iree_runner or "auto"
            )
            where, platform = f"IREE llvm-cpu modules through {runner}", "cpu"
        else:
            artifact = load(args.directory)
            errors = check_golden(artifact, args.steps)
            platform = artifact.platform
            where = f"{platform} (jax {jax.__version__})"
            if artifact.mesh is not None:
                where = f"{artifact.mesh.size} {platform} devices (jax {jax.__version__})"
    except ArtifactError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return _verdict(args, errors, where, platform)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Check a dense_armor artifact directory.")
    parser.add_argument("directory", nargs="?", default=str(pathlib.Path(__file__).parent))
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps of the stream to run (default: the golden ones); past those the last input "
        "repeats and each step is checked against the overflow contract",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="the largest error accepted (default 1e-4; 5e-2 for a bfloat16 or float16 model)",
    )
    parser.add_argument("--report", type=pathlib.Path, help="also write the errors here as JSON")
    parser.add_argument(
        "--iree", action="store_true", help="run the IREE-compiled modules in IREE's runtime"
    )
    parser.add_argument(
        "--iree-runner",
        choices=IREE_RUNNERS,
        help="for --iree: IREE's Python runtime in this process (python), IREE's own tool in a "
        "process per call (iree-run-module), or the first installed (auto, the default)",
    )
    parser.add_argument(
        "--pjrt", action="store_true", help="build runner.c and run the static modules from C"
    )
    parser.add_argument("--plugin", help="the PJRT plugin for --pjrt (default: xla-cpu-pjrt's)")
    parser.add_argument(
        "--device",
        choices=IREE_DEVICES,
        help="IREE's device for --iree: its thread pool (local-task, the default) or the calling "
        "thread (local-sync)",
    )
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    """The flags that go together, or an `ArtifactError`."""
    if args.pjrt and args.iree:
        raise ArtifactError("--pjrt and --iree are two checks: choose one.")
    for given, flag in ((args.device, "--device"), (args.iree_runner, "--iree-runner")):
        if given is not None and not args.iree:
            raise ArtifactError(f"{flag} chooses how IREE runs: it goes with --iree.")


def _from_c(args: argparse.Namespace) -> int:
    """The check from C (`--pjrt`): the runner's output passed on, its errors reported."""
    done = run_pjrt(args.directory, args.plugin, args.steps, tolerance=args.tolerance)
    print(done.stdout, end="")
    print(done.stderr, end="", file=sys.stderr)
    if args.report is not None and done.returncode in (0, 1):
        found = re.findall(r"^  (\S.*?)\s+max \|error\| = (\S+)", done.stdout, re.M)
        errors = {name: float(value) for name, value in found if name != "all"}
        report = {"errors": errors, "max": max(errors.values())}
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return done.returncode


def _verdict(args: argparse.Namespace, errors: dict[str, float], where: str, platform: str) -> int:
    """Each check's largest error printed against the tolerance (the manifest's for the
    platform, unless `--tolerance`), written to `--report`; 0 when all pass, else 1."""
    print(f"artifact {args.directory} on {where}")
    for name, value in errors.items():
        print(f"  {name:<36} max |error| = {value:.3e}")
    worst = max(errors.values())
    tolerance = args.tolerance
    if tolerance is None:  # half precision is compared with half-precision round-off
        manifest = read_manifest(pathlib.Path(args.directory))
        tolerance = checkers_tolerance(manifest, platform)
    if args.report is not None:
        args.report.write_text(json.dumps({"errors": errors, "max": worst}, indent=2) + "\n")
    print(f"  {'all':<36} max |error| = {worst:.3e} ({'ok' if worst <= tolerance else 'FAILED'})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
