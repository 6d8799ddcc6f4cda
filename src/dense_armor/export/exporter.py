"""Lower an encoder and its cached step to StableHLO artifacts with `jax.export`.

An artifact directory holds:

- `forward.jax_exported`: the batched forward `(weights..., x (B, T, n_in)) -> y (B, n_out)`,
  symbolic in `B` and in `T` (`1 <= T <= max_len`), for every requested platform;
- `step.jax_exported`: the cached step of the model's causal form,
  `(weights..., x_t (B, n_in), cache...) -> (y_t (B, n_out), cache..., overflow (B,))`, symbolic in
  `B`, with a fixed capacity; the cache is donated (aliased to the new cache in the module);
- `static/`: single-platform StableHLO modules with no symbolic dimension, for the shapes asked
  for, as text (`.mlir`) and bytecode (`.mlirbc`), for runtimes other than JAX;
- `weights.safetensors` (the weights are arguments of every function, never constants),
  `golden.safetensors` (inputs and the Python model's outputs), `run.py` (the standalone checker)
  and `manifest.json`, which describes all of it.
"""

import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import export
from safetensors.numpy import save_file

from .. import __version__
from ..checkpoint import ModelConfig, fill_tree, load_checkpoint, tree_arrays
from . import standalone
from .standalone import FORMAT, FORMAT_VERSION, MANIFEST, ArtifactError

__all__ = ["PLATFORMS", "ExportSummary", "export_checkpoint", "export_model"]

PLATFORMS = ("cpu", "cuda", "tpu")


@dataclasses.dataclass
class ExportSummary:
    """What an export wrote: the directory, each file's size in bytes, and the export time."""

    directory: pathlib.Path
    files: dict[str, int]
    seconds: float
    manifest: dict[str, Any]

    def __str__(self) -> str:
        lines = [f"exported to {self.directory} in {self.seconds:.1f} s:"]
        for name, size in sorted(self.files.items()):
            lines.append(f"  {name:<44} {size / 1024:>10.1f} KiB")
        lines.append(f"  {'total':<44} {sum(self.files.values()) / 1024:>10.1f} KiB")
        return "\n".join(lines)


def _spec(name: str, role: str, array_or_aval: Any, shape: Sequence[Any] | None = None) -> dict:
    dims = array_or_aval.shape if shape is None else shape
    return {
        "name": name,
        "role": role,
        "dtype": str(np.dtype(array_or_aval.dtype)),
        "shape": [d if isinstance(d, int) else str(d) for d in dims],
    }


class _Lowering:
    """The plain-array functions of one model; Equinox classes never reach a signature."""

    def __init__(self, model: Any, causal_model: Any, capacity: int):
        params, self.static = eqx.partition(model, eqx.is_array)
        paths_and_leaves = jax.tree_util.tree_leaves_with_path(params)
        self.names = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
        self.weights = [leaf for _, leaf in paths_and_leaves]
        self.treedef = jax.tree_util.tree_structure(params)
        causal_params, self.causal_static = eqx.partition(causal_model, eqx.is_array)
        self.causal_treedef = jax.tree_util.tree_structure(causal_params)
        cache = causal_model.init_cache(capacity, on_overflow="nan")
        cache_paths = jax.tree_util.tree_leaves_with_path(cache)
        self.cache_names = ["cache" + jax.tree_util.keystr(path) for path, _ in cache_paths]
        self.cache_leaves = [leaf for _, leaf in cache_paths]
        self.cache_treedef = jax.tree_util.tree_structure(cache)
        self.overflow_flags = [i for i, n in enumerate(self.cache_names) if n.endswith(".overflow")]

    def forward(self, weights: list[jax.Array], x: jax.Array) -> jax.Array:
        model = eqx.combine(jax.tree_util.tree_unflatten(self.treedef, weights), self.static)
        return jax.vmap(model)(x)

    def step(
        self, weights: list[jax.Array], x_t: jax.Array, cache: list[jax.Array]
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        model = eqx.combine(
            jax.tree_util.tree_unflatten(self.causal_treedef, weights), self.causal_static
        )
        tree = jax.tree_util.tree_unflatten(self.cache_treedef, cache)
        y_t, tree = jax.vmap(model.step)(x_t, tree)
        leaves = jax.tree_util.tree_leaves(tree)
        overflow = jnp.stack([leaves[i] for i in self.overflow_flags]).any(axis=0)
        return y_t, leaves, overflow

    def weight_specs(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in self.weights]

    def cache_specs(self, batch: Any) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct((batch, *c.shape), c.dtype) for c in self.cache_leaves]


def _causal_form(model: Any, config: ModelConfig) -> tuple[Any, ModelConfig]:
    if config.arguments.get("causal", False):
        return model, config
    causal = ModelConfig(config.factory, {**config.arguments, "causal": True})
    return fill_tree(causal.build(), tree_arrays(model)), causal


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_model(
    model: Any,
    config: ModelConfig,
    out: str | os.PathLike[str],
    *,
    capacity: int | None = None,
    platforms: Sequence[str] = PLATFORMS,
    static_shapes: Sequence[tuple[int, int]] | None = None,
    force: bool = False,
    seed: int = 0,
) -> ExportSummary:
    """Export `model` (built from `config`, a `transformer_encoder`) to the directory `out`.

    **Arguments:**

    - `capacity`: the step function's cache capacity (default `max_len`).
    - `platforms`: any of `cpu`, `cuda`, `tpu`; lowered here whatever machine this is.
    - `static_shapes`: `(B, T)` pairs for the static modules (default `(1, max_len)` and
      `(8, max_len)`); the step's static modules use each `B`.
    - `force`: replace `out` if it exists (otherwise that is an error).

    Nothing is left half-written: the directory is assembled beside `out` and renamed into place.
    """
    started = time.perf_counter()
    target = pathlib.Path(out)
    if target.exists() and not force:
        raise ArtifactError(f"{target} exists; pass force=True (`--force`) to replace it.")
    unknown = sorted(set(platforms) - set(PLATFORMS))
    if unknown or not platforms:
        raise ArtifactError(
            f"platforms must be a non-empty subset of {PLATFORMS}; got {platforms}."
        )
    if config.factory != "transformer_encoder":
        raise ArtifactError(f"export knows transformer_encoder models; got {config.factory!r}.")
    args = config.arguments
    max_len, n_in, n_out = int(args["max_len"]), int(args["n_in"]), int(args["n_out"])
    capacity = max_len if capacity is None else capacity
    if not capacity >= 1:
        raise ArtifactError(f"capacity must be positive; got {capacity}.")
    shapes = list(static_shapes or [(1, max_len), (8, max_len)])
    for b, t in shapes:
        if b < 1 or not 1 <= t <= max_len:
            raise ArtifactError(f"static shape B={b}, T={t} must have B >= 1, 1 <= T <= {max_len}.")
    fill_tree(config.build(), tree_arrays(model))  # the config and the weights must agree

    causal_model, causal_config = _causal_form(model, config)
    lowering = _Lowering(model, causal_model, capacity)
    forward = jax.jit(lowering.forward)
    step = jax.jit(lowering.step, donate_argnums=2)
    batch, time_ = export.symbolic_shape("B, T", constraints=(f"T <= {max_len}",))
    (step_batch,) = export.symbolic_shape("B")  # its own scope: the step has no T
    x_spec = jax.ShapeDtypeStruct((batch, time_, n_in), jnp.float32)
    x_t_spec = jax.ShapeDtypeStruct((step_batch, n_in), jnp.float32)
    w_specs = lowering.weight_specs()

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        exported = {
            "forward": export.export(forward, platforms=tuple(platforms))(w_specs, x_spec),
            "step": export.export(step, platforms=tuple(platforms))(
                w_specs, x_t_spec, lowering.cache_specs(step_batch)
            ),
        }
        for name, exp in exported.items():
            (tmp / f"{name}.jax_exported").write_bytes(exp.serialize())

        static_entries = []
        (tmp / "static").mkdir()
        step_batches = sorted({b for b, _ in shapes})
        jobs: list[tuple[str, int, int | None]] = [("forward", b, t) for b, t in shapes]
        jobs += [("step", b, None) for b in step_batches]
        for platform in platforms:
            for function, b, length in jobs:
                if function == "forward":
                    exp = export.export(forward, platforms=(platform,))(
                        w_specs, jax.ShapeDtypeStruct((b, length, n_in), jnp.float32)
                    )
                    stem = f"forward.{platform}.B{b}.T{length}"
                else:
                    exp = export.export(step, platforms=(platform,))(
                        w_specs,
                        jax.ShapeDtypeStruct((b, n_in), jnp.float32),
                        lowering.cache_specs(b),
                    )
                    stem = f"step.{platform}.B{b}"
                (tmp / "static" / f"{stem}.mlir").write_text(exp.mlir_module())
                (tmp / "static" / f"{stem}.mlirbc").write_bytes(exp.mlir_module_serialized)
                static_entries.append(
                    {
                        "function": function,
                        "platform": platform,
                        "shape": {"B": b, **({"T": length} if length is not None else {})},
                        "text": f"static/{stem}.mlir",
                        "bytecode": f"static/{stem}.mlirbc",
                    }
                )

        save_file(
            dict(zip(lowering.names, map(np.asarray, lowering.weights), strict=True)),
            str(tmp / "weights.safetensors"),
        )
        golden, golden_manifest = _golden(lowering, n_in, max_len, capacity, seed)
        save_file(golden, str(tmp / "golden.safetensors"))
        (tmp / "run.py").write_text(pathlib.Path(standalone.__file__).read_text())

        manifest = _manifest(
            lowering,
            exported,
            config,
            causal_config,
            capacity,
            max_len,
            n_in,
            n_out,
            platforms,
            static_entries,
            golden_manifest,
        )
        manifest["files"] = {
            str(path.relative_to(tmp)): {"sha256": _sha256(path), "bytes": path.stat().st_size}
            for path in sorted(tmp.rglob("*"))
            if path.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = {str(p.relative_to(target)): p.stat().st_size for p in target.rglob("*") if p.is_file()}
    return ExportSummary(target, files, time.perf_counter() - started, manifest)


def _golden(
    lowering: _Lowering, n_in: int, max_len: int, capacity: int, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Inputs and the Python model's outputs, for the forward and for `capacity` steps."""
    key = jax.random.PRNGKey(seed)
    cases = [(2, max_len), (3, min(5, max_len)), (1, 1)]
    golden: dict[str, np.ndarray] = {}
    forward_cases = []
    for i, (b, t) in enumerate(cases):
        x = jax.random.normal(jax.random.fold_in(key, i), (b, t, n_in))
        golden[f"forward.x{i}"] = np.asarray(x)
        golden[f"forward.y{i}"] = np.asarray(lowering.forward(lowering.weights, x))
        forward_cases.append({"input": f"forward.x{i}", "output": f"forward.y{i}", "B": b, "T": t})
    steps = capacity
    xs = jax.random.normal(jax.random.fold_in(key, 100), (2, steps, n_in))
    cache = [jnp.broadcast_to(c, (2, *c.shape)) for c in lowering.cache_leaves]
    step = jax.jit(lowering.step)
    ys = []
    for t in range(steps):
        y_t, cache, _ = step(lowering.weights, xs[:, t], cache)
        ys.append(np.asarray(y_t))
    golden["step.x"] = np.asarray(xs)
    golden["step.y"] = np.stack(ys, axis=1)
    return golden, {
        "file": "golden.safetensors",
        "forward": forward_cases,
        "step": {"x": "step.x", "y": "step.y", "B": 2, "steps": steps},
    }


def _manifest(
    lowering: _Lowering,
    exported: dict[str, export.Exported],
    config: ModelConfig,
    causal_config: ModelConfig,
    capacity: int,
    max_len: int,
    n_in: int,
    n_out: int,
    platforms: Sequence[str],
    static_entries: list[dict[str, Any]],
    golden: dict[str, Any],
) -> dict[str, Any]:
    weights = [_spec(n, "weight", w) for n, w in zip(lowering.names, lowering.weights, strict=True)]
    cache = [
        _spec(n, "cache", c, ["B", *c.shape])
        for n, c in zip(lowering.cache_names, lowering.cache_leaves, strict=True)
    ]
    platform_note = (
        "Exported.call selects the platform itself. In the StableHLO of a multi-platform module "
        "the first argument is an int32 scalar, the index of the running platform in `platforms`; "
        "single-platform modules (static/) have no such argument."
    )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.date.today().isoformat(),
        "versions": {
            "dense_armor": __version__,
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
        },
        "model": config.to_json(),
        "weights": {"file": "weights.safetensors", "names": lowering.names},
        "functions": {
            "forward": {
                "file": "forward.jax_exported",
                "platforms": list(platforms),
                "platform_index": platform_note,
                "inputs": [*weights, _spec("x", "input", jnp.zeros(0), ["B", "T", n_in])],
                "outputs": [
                    {"name": "y", "role": "output", "dtype": "float32", "shape": ["B", n_out]}
                ],
                "bounds": {"B": [1, 2**31 - 1], "T": [1, max_len]},
                "constraints": [f"T <= {max_len}"],
                "donated": [],
                "calling_convention_version": exported["forward"].calling_convention_version,
            },
            "step": {
                "file": "step.jax_exported",
                "platforms": list(platforms),
                "platform_index": platform_note,
                "model": causal_config.to_json(),
                "note": (
                    "the step of the model's causal form; it equals forward on every prefix "
                    "when the model itself is causal"
                ),
                "inputs": [
                    *weights,
                    _spec("x_t", "input", jnp.zeros(0), ["B", n_in]),
                    *cache,
                ],
                "outputs": [
                    {"name": "y_t", "role": "output", "dtype": "float32", "shape": ["B", n_out]},
                    *[{**c, "role": "cache"} for c in cache],
                    {"name": "overflow", "role": "output", "dtype": "bool", "shape": ["B"]},
                ],
                "bounds": {"B": [1, 2**31 - 1]},
                "donated": [c["name"] for c in cache],
                "capacity": capacity,
                "cache": {
                    "init": "every cache array zero (counters 0, flags false), batch B first",
                    "layout": (
                        "per layer, in order: positions (index, overflow); each block's "
                        "attention (keys, values: (B, capacity, d_model); index, overflow); "
                        "the mean over time (total, count)"
                    ),
                },
                "overflow": (
                    "a stream that steps past the cache capacity (or past max_len) gets NaN in its "
                    "row of y_t and true in `overflow`; its cache rows are never overwritten, and "
                    "the flag stays true. No host callbacks."
                ),
                "calling_convention_version": exported["step"].calling_convention_version,
            },
        },
        "static": static_entries,
        "golden": golden,
    }


def export_checkpoint(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], **options: Any
) -> ExportSummary:
    """Export the model of a checkpoint directory; options as in `export_model`."""
    saved = load_checkpoint(checkpoint)
    return export_model(saved.model, saved.config, out, **options)
