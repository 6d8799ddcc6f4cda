"""Lower a model and its cached step to StableHLO artifacts with `jax.export`.

Two model families export: `transformer_encoder` (`kind: encoder`) and `transformer_decoder`
(`kind: decoder`, which attends to a context). An artifact directory holds:

- `forward.jax_exported`: the batched forward, symbolic in the batch `B` and the time `T`
  (`1 <= T <= max_len`), and for a decoder in the context length `S`:
  encoder `(weights..., x (B, T, n_in)) -> y (B, n_out)`;
  decoder `(weights..., x (B, T, n_in), context (B, S, d_context), context_mask (B, S)) ->
  y (B, T, n_out)`;
- `step.jax_exported`: the cached step of the model's causal form,
  `(weights..., x_t (B, n_in), cache...) -> (y_t (B, n_out), cache..., overflow (B,))`, with a
  fixed capacity; the cache is donated (aliased to the new cache in the module);
- for a decoder, `init_cache.jax_exported`: `(weights..., context, context_mask) -> cache...`
  (an encoder's cache starts as zeros);
- `static/`: single-platform StableHLO with no symbolic dimension, for the shapes asked for, as
  text (`.mlir`) and bytecode (`.mlirbc`), for runtimes other than JAX;
- `weights.safetensors` (the weights are arguments of every function, never constants),
  `golden.safetensors` (inputs and the Python model's outputs), `run.py` (the standalone checker)
  and `manifest.json`, which describes all of it.
"""

import dataclasses
import datetime
import json
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import export
from safetensors.numpy import save_file

from .. import __version__, _atomic
from ..checkpoint import (
    ModelConfig,
    check_fits,
    fill_tree,
    load_checkpoint,
    skeleton,
    tree_arrays,
)
from ..distributed import gather_to_host
from ..utility.neural.cache import Counter
from . import standalone
from .standalone import FORMAT, FORMAT_VERSION, MANIFEST, ArtifactError

__all__ = ["PLATFORMS", "ExportSummary", "export_checkpoint", "export_model"]

PLATFORMS = ("cpu", "cuda", "tpu")
KINDS = {"transformer_encoder": "encoder", "transformer_decoder": "decoder"}
OVERFLOW = (
    "a stream that steps past the cache capacity (or past max_len) gets NaN in its row of y_t "
    "and true in `overflow`; its cache rows are never overwritten, and the flag stays true. "
    "No host callbacks."
)
PLATFORM_INDEX = (
    "Exported.call selects the platform itself. In the StableHLO of a multi-platform module the "
    "first argument is an int32 scalar, the index of the running platform in `platforms`; "
    "single-platform modules (static/) have no such argument."
)


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


Spec = dict[str, Any]  # {"name", "role", "dtype", "shape"}; shape entries are ints or dim names


def _spec(name: str, role: str, dtype: Any, shape: Sequence[Any]) -> Spec:
    return {
        "name": name,
        "role": role,
        "dtype": str(np.dtype(dtype)),
        "shape": [d if isinstance(d, int) else str(d) for d in shape],
    }


def _avals(specs: Sequence[Spec], sizes: dict[str, Any]) -> list[jax.ShapeDtypeStruct]:
    return [
        jax.ShapeDtypeStruct(
            tuple(sizes[d] if isinstance(d, str) else d for d in s["shape"]), s["dtype"]
        )
        for s in specs
    ]


@dataclasses.dataclass
class _Function:
    """One exported function: `fn(weights, *inputs)`, its non-weight inputs and its outputs."""

    fn: Callable[..., Any]
    inputs: list[Spec]
    outputs: list[Spec]
    symbols: str
    constraints: tuple[str, ...] = ()
    donate_cache: bool = False

    def jitted(self) -> Any:  # a jax.stages.Wrapped
        if not self.donate_cache:
            return jax.jit(self.fn)
        n_plain = len([i for i in self.inputs if i["role"] != "cache"])
        return jax.jit(self.fn, donate_argnums=1 + n_plain)

    def arguments(self, weights: list[Any], sizes: dict[str, Any]) -> list[Any]:
        """`(weight avals, *input avals)`, the cache inputs gathered into one list."""
        plain = [i for i in self.inputs if i["role"] != "cache"]
        cache = [i for i in self.inputs if i["role"] == "cache"]
        args: list[Any] = [weights, *_avals(plain, sizes)]
        return [*args, _avals(cache, sizes)] if cache else args


class _Lowering:
    """The plain-array functions of one model; Equinox classes never reach a signature."""

    def __init__(self, model: Any, causal_model: Any, config: ModelConfig, capacity: int):
        self.kind = KINDS[config.factory]
        args = config.arguments
        self.max_len, self.n_in, self.n_out = (
            int(args["max_len"]),
            int(args["n_in"]),
            int(args["n_out"]),
        )
        self.d_context = int(args.get("d_context") or args["d_model"])
        # Inputs are float32; outputs come in the compute dtype (see `Cast`).
        self.out_dtype = jnp.dtype(args.get("compute_dtype") or "float32")
        self.capacity = capacity
        params, self.static = eqx.partition(model, eqx.is_array)
        paths_and_leaves = jax.tree_util.tree_leaves_with_path(params)
        self.names = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
        # Host copies: a model trained sharded exports exactly as its single-device twin.
        self.weights = [jnp.asarray(gather_to_host(leaf)) for _, leaf in paths_and_leaves]
        self.treedef = jax.tree_util.tree_structure(params)
        causal_params, self.causal_static = eqx.partition(causal_model, eqx.is_array)
        self.causal_treedef = jax.tree_util.tree_structure(causal_params)

        # The cache's structure and shapes, with a symbolic context length for a decoder.
        (s_dim,) = export.symbolic_shape("S")
        context_avals = (
            (
                jax.ShapeDtypeStruct((s_dim, self.d_context), jnp.float32),
                jax.ShapeDtypeStruct((s_dim,), bool),
            )
            if self.kind == "decoder"
            else ()
        )
        cache_shape = jax.eval_shape(self._init_one, *context_avals)
        cache_paths = jax.tree_util.tree_leaves_with_path(cache_shape)
        self.cache_treedef = jax.tree_util.tree_structure(cache_shape)
        self.cache = [
            _spec("cache" + jax.tree_util.keystr(path), "cache", leaf.dtype, ["B", *leaf.shape])
            for path, leaf in cache_paths
        ]
        # The overflow flags are those of the cache's counters, found by type.
        flag_paths = {
            jax.tree_util.keystr((*path, jax.tree_util.GetAttrKey("overflow")))
            for path, node in jax.tree_util.tree_flatten_with_path(
                cache_shape, is_leaf=lambda n: isinstance(n, Counter)
            )[0]
            if isinstance(node, Counter)
        }
        self.overflow_flags = [
            i for i, (path, _) in enumerate(cache_paths) if jax.tree_util.keystr(path) in flag_paths
        ]

    # -- the model's pieces, for one sample -------------------------------------------------

    def _model(self, weights: list[jax.Array], causal: bool) -> Any:
        treedef, static = (
            (self.causal_treedef, self.causal_static) if causal else (self.treedef, self.static)
        )
        return eqx.combine(jax.tree_util.tree_unflatten(treedef, weights), static)

    def _init_one(self, *context: Any) -> Any:
        model = self._model(self.weights, causal=True)
        if self.kind == "decoder":
            ctx, mask = context
            return model.init_cache(ctx, self.capacity, context_mask=mask, on_overflow="nan")
        return model.init_cache(self.capacity, on_overflow="nan")

    # -- the exported functions ---------------------------------------------------------------

    def forward(self, weights: list[jax.Array], *inputs: jax.Array) -> jax.Array:
        model = self._model(weights, causal=False)
        if self.kind == "decoder":
            return jax.vmap(lambda x, c, m: model(x, c, context_mask=m))(*inputs)
        return jax.vmap(model)(*inputs)

    def init_cache(
        self, weights: list[jax.Array], context: jax.Array, context_mask: jax.Array
    ) -> list[jax.Array]:
        model = self._model(weights, causal=True)

        def one(c: jax.Array, m: jax.Array) -> Any:
            return model.init_cache(c, self.capacity, context_mask=m, on_overflow="nan")

        return jax.tree_util.tree_leaves(jax.vmap(one)(context, context_mask))

    def step(
        self, weights: list[jax.Array], x_t: jax.Array, cache: list[jax.Array]
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        model = self._model(weights, causal=True)
        tree = jax.tree_util.tree_unflatten(self.cache_treedef, cache)
        y_t, tree = jax.vmap(model.step)(x_t, tree)
        leaves = jax.tree_util.tree_leaves(tree)
        flags = [leaves[i] for i in self.overflow_flags]
        overflow = jnp.stack(flags).any(axis=0) if flags else jnp.zeros(x_t.shape[0], bool)
        return y_t, leaves, overflow

    def functions(self) -> dict[str, _Function]:
        f32 = jnp.float32
        overflow = _spec("overflow", "output", bool, ["B"])
        step = _Function(
            self.step,
            [_spec("x_t", "input", f32, ["B", self.n_in]), *self.cache],
            [_spec("y_t", "output", self.out_dtype, ["B", self.n_out]), *self.cache, overflow],
            "B, S" if self.kind == "decoder" else "B",
            donate_cache=True,
        )
        bound = (f"T <= {self.max_len}",)
        if self.kind == "encoder":
            return {
                "forward": _Function(
                    self.forward,
                    [_spec("x", "input", f32, ["B", "T", self.n_in])],
                    [_spec("y", "output", self.out_dtype, ["B", self.n_out])],
                    "B, T",
                    bound,
                ),
                "step": step,
            }
        context = [
            _spec("context", "context", f32, ["B", "S", self.d_context]),
            _spec("context_mask", "context", bool, ["B", "S"]),
        ]
        return {
            "forward": _Function(
                self.forward,
                [_spec("x", "input", f32, ["B", "T", self.n_in]), *context],
                [_spec("y", "output", self.out_dtype, ["B", "T", self.n_out])],
                "B, T, S",
                bound,
            ),
            "init_cache": _Function(self.init_cache, context, self.cache, "B, S"),
            "step": step,
        }


def _causal_form(model: Any, config: ModelConfig) -> tuple[Any, ModelConfig]:
    if KINDS[config.factory] == "decoder" or config.arguments.get("causal", False):
        return model, config
    causal = ModelConfig(config.factory, {**config.arguments, "causal": True})
    return fill_tree(skeleton(causal), tree_arrays(model)), causal


def export_model(
    model: Any,
    config: ModelConfig,
    out: str | os.PathLike[str],
    *,
    capacity: int | None = None,
    platforms: Sequence[str] = PLATFORMS,
    static_shapes: Sequence[tuple[int, ...]] | None = None,
    force: bool = False,
    seed: int = 0,
) -> ExportSummary:
    """Export `model` (built from `config`) to the directory `out`.

    **Arguments:**

    - `capacity`: the step function's cache capacity (default `max_len`).
    - `platforms`: any of `cpu`, `cuda`, `tpu`; lowered here whatever machine this is.
    - `static_shapes`: `(B, T)` pairs for the static modules (`(B, T, S)` for a decoder; default
      `(1, max_len)` and `(8, max_len)`, with `S = max_len`); the step uses each `B` (and `S`).
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
    if config.factory not in KINDS:
        raise ArtifactError(f"export knows {sorted(KINDS)} models; got {config.factory!r}.")
    max_len = int(config.arguments["max_len"])
    capacity = max_len if capacity is None else capacity
    if capacity < 1:
        raise ArtifactError(f"capacity must be positive; got {capacity}.")
    shapes = [
        _static_sizes(s, max_len, KINDS[config.factory])
        for s in static_shapes or [(1, max_len), (8, max_len)]
    ]
    check_fits(config, tree_arrays(model))  # the config and the weights must agree

    causal_model, causal_config = _causal_form(model, config)
    lowering = _Lowering(model, causal_model, config, capacity)
    functions = lowering.functions()
    weight_avals = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in lowering.weights]

    summary: dict[str, Any] = {}

    def fill(tmp: pathlib.Path) -> None:
        exported = {}
        for name, function in functions.items():
            dims = export.symbolic_shape(function.symbols, constraints=function.constraints)
            sizes = dict(zip([d.strip() for d in function.symbols.split(",")], dims, strict=True))
            exported[name] = export.export(function.jitted(), platforms=tuple(platforms))(
                *function.arguments(weight_avals, sizes)
            )
            (tmp / f"{name}.jax_exported").write_bytes(exported[name].serialize())

        static_entries = []
        (tmp / "static").mkdir()
        for platform in platforms:
            for name, function in functions.items():
                symbols = [d.strip() for d in function.symbols.split(",")]
                seen = set()
                for shape in shapes:
                    sizes = {d: shape[d] for d in symbols}
                    if tuple(sizes.items()) in seen:
                        continue
                    seen.add(tuple(sizes.items()))
                    module = export.export(function.jitted(), platforms=(platform,))(
                        *function.arguments(weight_avals, sizes)
                    )
                    stem = ".".join([name, platform, *(f"{d}{v}" for d, v in sizes.items())])
                    (tmp / "static" / f"{stem}.mlir").write_text(module.mlir_module())
                    (tmp / "static" / f"{stem}.mlirbc").write_bytes(module.mlir_module_serialized)
                    static_entries.append(
                        {
                            "function": name,
                            "platform": platform,
                            "shape": sizes,
                            "text": f"static/{stem}.mlir",
                            "bytecode": f"static/{stem}.mlirbc",
                        }
                    )

        save_file(
            dict(zip(lowering.names, map(np.asarray, lowering.weights), strict=True)),
            str(tmp / "weights.safetensors"),
        )
        golden, golden_manifest = _golden(lowering, seed)
        save_file(golden, str(tmp / "golden.safetensors"))
        (tmp / "run.py").write_text(pathlib.Path(standalone.__file__).read_text())

        manifest = _manifest(
            lowering,
            functions,
            exported,
            config,
            causal_config,
            platforms,
            static_entries,
            golden_manifest,
        )
        manifest["files"] = {
            str(path.relative_to(tmp)): {
                "sha256": standalone.sha256(path),
                "bytes": path.stat().st_size,
            }
            for path in sorted(tmp.rglob("*"))
            if path.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        summary["manifest"] = manifest

    if target.exists() and not target.is_dir():
        raise ArtifactError(f"{target} exists and is not a directory.")
    _atomic.write_directory(target, fill)
    files = {str(p.relative_to(target)): p.stat().st_size for p in target.rglob("*") if p.is_file()}
    return ExportSummary(target, files, time.perf_counter() - started, summary["manifest"])


def _static_sizes(shape: Sequence[int], max_len: int, kind: str) -> dict[str, int]:
    if len(shape) not in (2, 3) or (len(shape) == 3 and kind == "encoder"):
        raise ArtifactError(
            f"a static shape is B,T{' or B,T,S' if kind == 'decoder' else ''}; got {tuple(shape)}."
        )
    b, t, *rest = shape
    s = rest[0] if rest else max_len
    if b < 1 or not 1 <= t <= max_len or s < 1:
        raise ArtifactError(
            f"static shape B={b}, T={t}, S={s} must have B >= 1, 1 <= T <= {max_len}, S >= 1."
        )
    return {"B": b, "T": t, "S": s}


def _golden(lowering: _Lowering, seed: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Inputs and the Python model's outputs: three forward shapes, and `capacity` steps."""
    key = jax.random.PRNGKey(seed)
    n_in, max_len, d_context = lowering.n_in, lowering.max_len, lowering.d_context
    decoder = lowering.kind == "decoder"
    golden: dict[str, np.ndarray] = {}

    def context(i: int, b: int, s: int, padded: bool) -> list[str]:
        golden[f"context{i}"] = np.asarray(
            jax.random.normal(jax.random.fold_in(key, 1000 + i), (b, s, d_context))
        )
        mask = np.ones((b, s), bool)
        if padded and s > 1:
            mask[0, -1] = False  # one padded context step in the first sequence
        golden[f"context_mask{i}"] = mask
        return [f"context{i}", f"context_mask{i}"]

    forward_cases = []
    for i, (b, t, s) in enumerate([(2, max_len, 5), (3, min(5, max_len), 3), (1, 1, 1)]):
        golden[f"forward.x{i}"] = np.asarray(
            jax.random.normal(jax.random.fold_in(key, i), (b, t, n_in))
        )
        inputs = [f"forward.x{i}", *(context(i, b, s, padded=True) if decoder else [])]
        golden[f"forward.y{i}"] = np.asarray(  # outputs are stored as float32
            jax.jit(lowering.forward)(lowering.weights, *(golden[k] for k in inputs)), np.float32
        )
        forward_cases.append({"inputs": inputs, "output": f"forward.y{i}", "B": b, "T": t})

    steps, b = lowering.capacity, 2
    xs = jax.random.normal(jax.random.fold_in(key, 100), (b, steps, n_in))
    if decoder:
        context_keys = context(9, b, 4, padded=False)
        cache = jax.jit(lowering.init_cache)(lowering.weights, *(golden[k] for k in context_keys))
    else:
        context_keys = []
        cache = [jnp.zeros(_shape(s, {"B": b}), s["dtype"]) for s in lowering.cache]
    step = jax.jit(lowering.step)
    ys = []
    for t in range(steps):
        y_t, cache, _ = step(lowering.weights, xs[:, t], cache)
        ys.append(np.asarray(y_t, np.float32))
    golden["step.x"] = np.asarray(xs)
    golden["step.y"] = np.stack(ys, axis=1)
    return golden, {
        "file": "golden.safetensors",
        "forward": forward_cases,
        "step": {"context": context_keys, "x": "step.x", "y": "step.y", "B": b, "steps": steps},
    }


def _shape(spec: Spec, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[d] if isinstance(d, str) else d for d in spec["shape"])


def _manifest(
    lowering: _Lowering,
    functions: dict[str, _Function],
    exported: dict[str, export.Exported],
    config: ModelConfig,
    causal_config: ModelConfig,
    platforms: Sequence[str],
    static_entries: list[dict[str, Any]],
    golden: dict[str, Any],
) -> dict[str, Any]:
    weights = [
        _spec(n, "weight", w.dtype, w.shape)
        for n, w in zip(lowering.names, lowering.weights, strict=True)
    ]
    described = {}
    for name, function in functions.items():
        entry: dict[str, Any] = {
            "file": f"{name}.jax_exported",
            "platforms": list(platforms),
            "platform_index": PLATFORM_INDEX,
            "inputs": [*weights, *function.inputs],
            "outputs": function.outputs,
            "bounds": {
                d.strip(): [1, lowering.max_len if d.strip() == "T" else 2**31 - 1]
                for d in function.symbols.split(",")
            },
            "constraints": list(function.constraints),
            "donated": [i["name"] for i in function.inputs if i["role"] == "cache"]
            if function.donate_cache
            else [],
            "calling_convention_version": exported[name].calling_convention_version,
        }
        if name == "step":
            entry.update(
                model=causal_config.to_json(),
                note="the step of the model's causal form; it equals forward on every prefix "
                "when the model itself is causal",
                capacity=lowering.capacity,
                overflow=OVERFLOW,
                cache={
                    "init": (
                        "the outputs of init_cache(context, context_mask)"
                        if lowering.kind == "decoder"
                        else "every cache array zero (counters 0, flags false), batch B first"
                    ),
                    "layout": "one entry per cache array, named by its path in the model's "
                    "cache tree: positions (counter.index, counter.overflow); each attention's "
                    "keys and values (B, n_heads, capacity, d_head) and counter; a decoder's "
                    "projected context (B, S, d_model) and its mask; the mean over time (total, "
                    "count)",
                },
            )
        described[name] = entry
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": lowering.kind,
        "created": datetime.date.today().isoformat(),
        "versions": {
            "dense_armor": __version__,
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
        },
        "model": config.to_json(),
        "weights": {"file": "weights.safetensors", "names": lowering.names},
        "functions": described,
        "static": static_entries,
        "golden": golden,
    }


def export_checkpoint(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], **options: Any
) -> ExportSummary:
    """Export the model of a checkpoint directory; options as in `export_model`."""
    saved = load_checkpoint(checkpoint)
    return export_model(saved.model, saved.config, out, **options)
