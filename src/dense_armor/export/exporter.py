"""Lower a model and its streaming functions to StableHLO artifacts with `jax.export`.

Every family in `dense_armor.checkpoints.families` exports (`transformer_encoder`, `kind: encoder`;
`transformer_decoder`, `kind: decoder`, which attends to a context; and `transformer_lm`,
`kind: language_model`, whose inputs are int32 token ids: `x (B, T)`, `x_t (B,)`, and whose
outputs are the next token's logits at every step, `(B, T, vocab)` and `(B, vocab)`). An artifact
directory holds:

- `forward.jax_exported`: the batched forward, symbolic in the batch `B` and the time `T`
  (`1 <= T <= max_len`), and for a decoder in the context length `S`:
  encoder `(weights..., x (B, T, n_in)) -> y (B, n_out)`;
  decoder `(weights..., x (B, T, n_in), context (B, S, d_context), context_mask (B, S)) ->
  y (B, T, n_out)`;
- the streaming functions of the model's causal form, with a fixed cache capacity; the cache is
  a list of arrays, batch first, described in the manifest's `cache.layout`, and donated (aliased
  to the new cache in the module) wherever it is an input:
  `init_cache.jax_exported`: `(weights..., streams (B,)) -> cache...` (a decoder:
  `(weights..., context, context_mask) -> cache...`, the context projected once);
  `step.jax_exported`: `(weights..., x_t (B, n_in), cache...) -> (y_t, cache..., overflow (B,))`;
  `prefill.jax_exported`: `(weights..., x (B, T, n_in), cache...) -> (y (B, T, ...), cache...,
  overflow (B,))`, any chunk length `T`: what `T` steps return;
  `reset.jax_exported`: `(weights..., streams (B,), [context, context_mask,] cache...) ->
  cache...`: the streams where `streams` is true start again (with their new context);
- a language model's decoding, the sampling in the graph (`sampling=` at export, greedy by
  default; the manifest's `sampling`): `sample_prefill.jax_exported`: `(weights..., x (B, T),
  key uint32[2], cache...) -> (token (B,), cache..., overflow (B,))`, each stream's first new
  token after its prompt, and `sample_step.jax_exported`: `(weights..., x_t (B,), key,
  cache...) -> (token (B,), cache..., overflow (B,))`, the next;
- `static/`: single-platform StableHLO with no symbolic dimension, for the shapes asked for, as
  text (`.mlir`) and bytecode (`.mlirbc`), for runtimes other than JAX;
- `weights.safetensors` (the weights are arguments of every function, never constants),
  `golden.safetensors` (inputs and the Python model's outputs), `run.py` (the standalone checker),
  `runner.c` and `pjrt_c_api.h` (the same check from C through a PJRT plugin, the static modules
  compiled by the plugin) and `manifest.json`, which describes all of it.
"""

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax

from ..checkpoints import atomic
from ..checkpoints.families import FAMILIES
from ..checkpoints.single import (
    ModelConfig,
    check_fits,
    fill_tree,
    load_checkpoint,
    skeleton,
    tree_arrays,
)
from ..checkpoints.tensors import write_safetensors
from ..nn.core import require_bool, require_int
from ..nn.kernels.choice import exporting
from ..nn.models.generation import check_kv_dtype
from ..nn.sampling import check_sampling
from . import standalone
from .golden import golden
from .layout import export_mesh
from .lowering import GREEDY, Lowering
from .manifest import accelerator_tolerance, created, half_tolerance
from .manifest import manifest as describe
from .modules import write_portable, write_runner, write_static
from .standalone import MANIFEST, ArtifactError

__all__ = ["PLATFORMS", "ExportSummary", "export_checkpoint", "export_model"]

PLATFORMS = ("cpu", "cuda", "tpu")
# float32 products in the exported functions: "highest" (full float32 on every platform, so an
# artifact gives the golden outputs on a GPU as on the CPU) or "default" (the platform's own
# choice: TF32 on recent NVIDIA GPUs, bfloat16 passes on TPUs; faster, about 1e-3 apart).
MATMUL_PRECISIONS = ("highest", "default")


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
    matmul_precision: str = "highest",
    sampling: dict[str, Any] | None = None,
    kv_dtype: str | None = None,
    mesh: Any = None,
) -> ExportSummary:
    """Export `model` (built from `config`) to the directory `out`.

    **Arguments:**

    - `capacity`: the step function's cache capacity (default `max_len`; past it only with a
      `window`: the positions stop at `max_len`, so a larger cache could never fill).
    - `platforms`: any of `cpu`, `cuda`, `tpu`; lowered here whatever machine this is.
    - `static_shapes`: `(B, T)` pairs for the static modules (`(B, T, S)` for a decoder; default
      `(1, max_len)` and `(8, max_len)`, with `S = max_len`; `[]`: none); the streaming functions
      use each `B` (and `S`), `prefill` also each `T`.
    - `force`: replace `out` if it exists (otherwise that is an error).
    - `matmul_precision`: the precision of float32 matrix products in every exported function,
      `"highest"` (default: full float32, so the artifact matches its golden outputs on GPUs and
      TPUs as on CPUs) or `"default"` (the platform's own: TF32 on NVIDIA GPUs since Ampere,
      faster, about 1e-3 apart); recorded in the manifest.
    - `sampling`: a language model's decoding rules in `sample_prefill` and `sample_step`, any of
      `temperature`, `top_k`, `top_p`, `min_p` as in `generate` (default greedy); fixed in the
      graph and recorded in the manifest.
    - `kv_dtype`: a language model's cache keys and values in another dtype (`"int8"`: int8
      rows with a float32 scale per head and position; `"bfloat16"`, `"float16"`), as the
      manifest's cache layout says. The weights are exported as the model holds them (bfloat16,
      int8 with their scales), the dequantization in the graph.
    - `mesh`: the modules laid out over `N` devices (`AbstractMesh((N,), ("model",))` or a
      `Mesh`), split as generation splits the model (`export.layout`); golden outputs one device's.

    Nothing is left half-written: the directory is assembled beside `out` and renamed into place.
    """
    started, target = time.perf_counter(), pathlib.Path(out)
    capacity, shapes = _check_export(
        config, target, capacity, platforms, static_shapes, force, seed, matmul_precision
    )
    sampling, abstract = _check_sampling(config, sampling), export_mesh(mesh)
    _check_kv_dtype(config, kv_dtype)
    check_fits(config, tree_arrays(model))  # the config and the weights must agree
    # cuDNN's attention lowers as XLA's (jax.export refuses its custom call), the golden outputs
    # too; every product traced (and so written into the modules) at `matmul_precision`
    with exporting(), jax.default_matmul_precision(matmul_precision):
        lowering = Lowering(
            model, _causal(model, config), config, capacity, sampling, kv_dtype, abstract
        )
        functions = lowering.functions(platforms)
        plan = _Plan(lowering, functions, config, platforms, shapes, seed, matmul_precision)
        atomic.write_directory(target, plan.fill)
    files = {str(p.relative_to(target)): p.stat().st_size for p in target.rglob("*") if p.is_file()}
    return ExportSummary(target, files, time.perf_counter() - started, plan.manifest)


def _causal(model: Any, config: ModelConfig) -> Any:
    """The model's causal form (the streaming functions'): itself, or its weights in the causal
    form of its family."""
    causal_config = config.causal()
    if causal_config == config:
        return model
    return fill_tree(skeleton(causal_config), tree_arrays(model))


@dataclasses.dataclass
class _Plan:
    """What an export writes into its directory, from its lowering: the portable and static
    modules, the weights, the golden cases, the standalone runners and the manifest."""

    lowering: Lowering
    functions: Any
    config: ModelConfig
    platforms: Sequence[str]
    shapes: Any
    seed: int
    matmul_precision: str
    manifest: dict[str, Any] = dataclasses.field(default_factory=dict)

    def fill(self, tmp: pathlib.Path) -> None:
        """Write the artifact's files into `tmp` (renamed into place once whole)."""
        lowering, functions, platforms = self.lowering, self.functions, self.platforms
        exported, stripped = write_portable(tmp, functions, platforms)
        static_entries, static_stripped = write_static(
            tmp, functions, lowering, platforms, self.shapes
        )
        write_safetensors(
            dict(zip(lowering.names, lowering.weights, strict=True)), tmp / "weights.safetensors"
        )
        golden_arrays, golden_plan = golden(lowering, self.seed, functions, static_entries)
        write_safetensors(golden_arrays, tmp / "golden.safetensors")
        (tmp / "run.py").write_text(pathlib.Path(standalone.__file__).read_text())
        pjrt = write_runner(tmp)
        manifest = describe(
            lowering, functions, exported, self.config, self.config.causal(), platforms,
            static_entries,
        )  # fmt: skip
        precision = manifest["precision"]
        precision["tolerance"] = half_tolerance(precision, golden_arrays)
        precision["accelerator_tolerance"] = accelerator_tolerance(
            precision, golden_arrays, self.matmul_precision
        )
        manifest.update(
            golden=golden_plan, pjrt=pjrt, matmul_precision=self.matmul_precision,
            debug_locations="stripped" if stripped and static_stripped else "kept",
        )  # fmt: skip
        manifest["files"] = standalone.file_table(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        self.manifest = manifest


def _check_export(
    config: ModelConfig,
    target: pathlib.Path,
    capacity: Any,
    platforms: Any,
    static_shapes: Sequence[tuple[int, ...]] | None,
    force: Any,
    seed: Any,
    matmul_precision: Any,
) -> tuple[int, list[dict[str, int]]]:
    """`export_model`'s arguments checked before any work; the capacity, and the sizes of each
    static module."""
    try:  # a string such as "false" would be a true `force`, and replace the user's directory
        require_bool(force=force)
    except ValueError as error:
        raise ArtifactError(f"export_model: {error}") from None
    require_int(0, caller="export_model", error=ArtifactError, seed=seed)
    created()  # a malformed SOURCE_DATE_EPOCH is refused before any work
    if isinstance(platforms, str) or not isinstance(platforms, Sequence):
        raise ArtifactError(
            f"export_model: `platforms` must be a list of platform names from {PLATFORMS}, e.g. "
            f'["cpu"]; received {platforms!r}.'
        )
    if target.exists() and not force:
        raise ArtifactError(f"{target} exists; pass force=True (`--force`) to replace it.")
    if target.exists() and not target.is_dir():
        raise ArtifactError(f"{target} exists and is not a directory.")
    if matmul_precision not in MATMUL_PRECISIONS:
        raise ArtifactError(
            f"matmul_precision must be one of {MATMUL_PRECISIONS}; got {matmul_precision!r}."
        )
    unknown = sorted(set(platforms) - set(PLATFORMS))
    if unknown or not platforms:
        raise ArtifactError(
            f"platforms must be a non-empty subset of {PLATFORMS}; got {platforms}."
        )
    family = FAMILIES[config.factory]
    max_len = family.max_length(config.arguments)
    capacity = max_len if capacity is None else capacity
    require_int(1, caller="export_model", error=ArtifactError, capacity=capacity)
    end = family.positions_end(config.arguments)
    if end is not None and capacity > end:
        raise ArtifactError(
            f"capacity {capacity} > max_len {max_len}: the positional encoding of this model "
            f"stops at step {max_len}, so every stream would overflow there whatever the cache "
            f"holds. Export with capacity <= {max_len} (or build the model with a larger "
            "max_len, or with a window, whose ring cache never fills)."
        )
    with_context = family.context_width(config.arguments) is not None
    shapes = [
        _static_sizes(s, max_len, with_context)
        for s in ([(1, max_len), (8, max_len)] if static_shapes is None else static_shapes)
    ]
    return int(capacity), shapes


def _check_kv_dtype(config: ModelConfig, kv_dtype: Any) -> None:
    """`export_model`'s `kv_dtype`: one of `nn.precision.KV_DTYPES`, for a language model."""
    if kv_dtype is None:
        return
    if not FAMILIES[config.factory].token_ids:
        raise ArtifactError(
            f"export_model: `kv_dtype` is for a language model's cache; a {config.factory} "
            "keeps float32 keys and values."
        )
    try:
        check_kv_dtype("export_model", kv_dtype)  # generate's and the Server's check
    except ValueError as error:
        raise ArtifactError(str(error)) from None


def _check_sampling(config: ModelConfig, sampling: Any) -> dict[str, Any] | None:
    """`export_model`'s `sampling`, checked: for a language model only, the rules of
    `generate`."""
    if sampling is None:
        return None
    if FAMILIES[config.factory].vocabulary(config.arguments) is None:
        raise ArtifactError(
            f"export_model: `sampling` is for a language model's decoding; a "
            f"{config.factory!r} model has no tokens to sample."
        )
    if not isinstance(sampling, dict) or set(sampling) - set(GREEDY):
        raise ArtifactError(
            f"export_model: `sampling` must be a dict of {sorted(GREEDY)}; received {sampling!r}."
        )
    try:
        check_sampling(**sampling)
    except ValueError as error:
        raise ArtifactError(f"export_model: sampling: {error}") from None
    return {**GREEDY, **sampling}


def _static_sizes(shape: Sequence[int], max_len: int, with_context: bool) -> dict[str, int]:
    form = f"(B, T){' or (B, T, S)' if with_context else ''}"
    if (
        isinstance(shape, str)
        or not isinstance(shape, Sequence)
        or len(shape) not in (2, 3)
        or (len(shape) == 3 and not with_context)
    ):
        raise ArtifactError(f"a static shape is {form}, a tuple of integers; got {shape!r}.")
    for name, size in zip("BTS", shape, strict=False):
        require_int(1, caller=f"static shape {tuple(shape)}", error=ArtifactError, **{name: size})
    b, t, *rest = (int(size) for size in shape)
    s = rest[0] if rest else max_len
    if b < 1 or not 1 <= t <= max_len or s < 1:
        raise ArtifactError(
            f"static shape B={b}, T={t}, S={s} must have B >= 1, 1 <= T <= {max_len}, S >= 1."
        )
    return {"B": b, "T": t, "S": s}


def export_checkpoint(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], **options: Any
) -> ExportSummary:
    """Export the model of a checkpoint directory; options as in `export_model`."""
    saved = load_checkpoint(checkpoint)
    return export_model(saved.model, saved.config, out, **options)
