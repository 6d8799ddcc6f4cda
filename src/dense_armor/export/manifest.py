"""What an artifact's `manifest.json` says of its model and functions: every function's inputs
and outputs, the cache's layout and overflow rule, the token ids and sampling of a language
model, the precision of its weights and cache (and the checkers' tolerance), its date and its
compatibility window. `exporter.export_model` writes it."""

import datetime
import os
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
from jax import export
from jax.sharding import NamedSharding

from .. import __version__
from ..checkpoints.single import ModelConfig
from .functions import Function, spec
from .layout import sharding_entry
from .lowering import Lowering
from .standalone import FORMAT, FORMAT_VERSION, ArtifactError

__all__ = ["created", "manifest"]

OVERFLOW = (
    "a stream that steps (or prefills) past the cache capacity (or past max_len) gets NaN in "
    "those rows of its output and true in `overflow`; its cache rows are never overwritten, and "
    "the flag stays true until the stream is reset. No host callbacks."
)
PLATFORM_INDEX = (
    "Exported.call selects the platform itself. In the StableHLO of a multi-platform module the "
    "first argument is an int32 scalar, the index of the running platform in `platforms`; "
    "single-platform modules (static/) have no such argument."
)


def created() -> str:
    """The artifact's date: today, or the day of `SOURCE_DATE_EPOCH` (seconds since 1970, the
    reproducible-builds convention) when it is set, so that exports of one model on different
    days can be the same bytes."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        return datetime.date.today().isoformat()
    try:  # not an integer, or a date past what a calendar holds
        return datetime.datetime.fromtimestamp(int(epoch), datetime.UTC).date().isoformat()
    except (ValueError, OverflowError, OSError):
        raise ArtifactError(
            "export_model: `SOURCE_DATE_EPOCH` must be an integer number of seconds since "
            f"1970-01-01 UTC (the date written as the artifact's `created`); received {epoch!r}."
        ) from None


def manifest(
    lowering: Lowering,
    functions: dict[str, Function],
    exported: dict[str, export.Exported],
    config: ModelConfig,
    causal_config: ModelConfig,
    platforms: Sequence[str],
    static_entries: list[dict[str, Any]],
) -> dict[str, Any]:
    weights = [
        spec(n, "weight", w.dtype, w.shape)
        for n, w in zip(lowering.names, lowering.weights, strict=True)
    ]
    described = {}
    for name, function in functions.items():
        described[name] = {
            "file": f"{name}.jax_exported",
            "platforms": list(platforms),
            "platform_index": PLATFORM_INDEX,
            "inputs": [*weights, *function.inputs],
            "outputs": function.outputs,
            "bounds": {d: [1, function.bounds.get(d, 2**31 - 1)] for d in function.symbols},
            "donated": [i["name"] for i in function.cache],
            "calling_convention_version": exported[name].calling_convention_version,
        }
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": lowering.family.kind,
        "created": created(),
        "versions": {
            "dense_armor": __version__,
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
        },
        "model": config.to_json(),
        "weights": {"file": "weights.safetensors", "names": lowering.names},
        "functions": described,
        **_token_ids(lowering),
        "precision": _precision(lowering),
        "streaming": {
            "model": causal_config.to_json(),
            "note": "init_cache, step, prefill and reset belong to the model's causal form; its "
            "step equals forward on every prefix when the model itself is causal",
            "capacity": lowering.capacity,
            "overflow": OVERFLOW,
            "start": "a stream's cache starts as init_cache returns it; reset returns the chosen "
            "streams to that state",
            "layout": lowering.cache_layout,
        },
        "static": static_entries,
        "compatibility": _compatibility(exported),
        **_mesh(lowering, described, exported),
    }


def _mesh(
    lowering: Lowering, described: dict[str, Any], exported: dict[str, export.Exported]
) -> dict[str, Any]:
    """A laid-out artifact's `mesh`, and each function's inputs and outputs marked with their
    `sharding` (read from its module's own shardings); nothing for one device."""
    if lowering.layout is None:
        return {}
    mesh = lowering.layout.mesh
    for name, entry in described.items():
        module = exported[name]
        entry["inputs"] = [dict(s) for s in entry["inputs"]]
        entry["outputs"] = [dict(s) for s in entry["outputs"]]
        for specs, shardings in (
            (entry["inputs"], module.in_shardings_jax(mesh)),
            (entry["outputs"], module.out_shardings_jax(mesh)),
        ):
            for s, sharding in zip(specs, shardings, strict=True):
                assert isinstance(sharding, NamedSharding), (name, s["name"], sharding)
                s["sharding"] = sharding_entry(sharding.spec, len(s["shape"]))
    return {"mesh": lowering.layout.manifest()}


INVALID_IDS = (
    "an id outside [0, vocab) gives NaN logits in its rows (an artifact cannot raise): check ids "
    "before the call. In prefill and step it also leaves NaN keys and values in that stream's "
    "cache, so its later logits are NaN too until the stream is reset."
)


def _token_ids(lowering: Lowering) -> dict[str, Any]:
    """The manifest's `token_ids` entry, for a family whose inputs are token ids."""
    if lowering.vocab is None:
        return {}
    return {
        "token_ids": {"dtype": "int32", "vocab": lowering.vocab, "invalid": INVALID_IDS},
        "sampling": {**lowering.sampling, "rule": SAMPLING_RULE},
    }


def _precision(lowering: Lowering) -> dict[str, Any]:
    """The manifest's `precision`: the weights' dtypes (a count of arrays of each), and the
    cache's keys and values."""
    dtypes: dict[str, int] = {}
    for w in lowering.weights:
        dtypes[str(np.dtype(w.dtype))] = dtypes.get(str(np.dtype(w.dtype)), 0) + 1
    arguments = lowering.arguments
    compute = arguments.get("compute_dtype") or arguments.get("param_dtype") or "float32"
    half = _half(compute, lowering.kv_dtype or "float32")
    return {
        "weights": dict(sorted(dtypes.items())),
        "compute_dtype": compute,
        "kv_dtype": lowering.kv_dtype or "float32",
        # the checkers' default: half precision (or an int8 cache, whose rows round to the
        # nearest of 255 levels) is compared with its own round-off (`half_tolerance` scales it
        # by the golden outputs once they are made)
        "tolerance": HALF_TOLERANCE if half else 1e-4,
        "note": "int8 weights are exported with their float32 scales (the `.scale` arrays beside "
        "each `.value`), multiplied in the graph; an int8 cache keeps a float32 scale per head "
        "and position for its keys and for its values",
    }


# Half precision's tolerance: 5e-2, or 2**-6 of the largest golden output where that is more
# (bfloat16 keeps 8 significant bits: outputs near 10 are 0.0625 apart, and another CPU's dot
# paths, AMX's pairwise bfloat16 products among them, round a step or two the other way).
HALF_TOLERANCE = 5e-2


def _half(compute_dtype: str, kv_dtype: str) -> bool:
    """Whether an artifact computes in half precision or keeps an int8 cache."""
    return compute_dtype != "float32" or kv_dtype != "float32"


def half_tolerance(precision: dict[str, Any], golden: dict[str, np.ndarray]) -> float:
    """The checkers' tolerance for an artifact of this `precision` with these golden arrays."""
    if not _half(precision["compute_dtype"], precision["kv_dtype"]):
        return precision["tolerance"]
    largest = [
        float(np.abs(a.astype(np.float32)).max(initial=0.0))
        for a in golden.values()
        if a.dtype.kind not in "biu"  # float32, float16 and bfloat16 (numpy kind "V")
    ]
    return max([HALF_TOLERANCE, *(2**-6 * x for x in largest if np.isfinite(x))])


# An accelerator's float32 arithmetic is not the CPU's: a TPU's exp, log, logistic and softplus
# are approximations (measured on a v5e against float64: relative errors up to 4e-6, 3e-4 near
# log's zero, 5e-5 and 1e-6), which a gated recurrence compounds (Qwen3.5's Gated DeltaNet,
# 5e-4 on logits of 2.7, its tokens unchanged), and products at the platform's own precision
# ("default": bfloat16 passes on a TPU, TF32 on a GPU) are about 1e-3 apart.
ACCELERATOR_RELATIVE = 2**-11
DEFAULT_PRODUCTS_TOLERANCE = 2e-2


def accelerator_tolerance(
    precision: dict[str, Any], golden: dict[str, np.ndarray], matmul_precision: str
) -> float:
    """The checkers' tolerance on an accelerator: the CPU's, or `ACCELERATOR_RELATIVE` of the
    largest golden output where that is more (2e-2 at least for products at the platform's own
    precision). Tokens are compared exactly everywhere."""
    largest = [
        float(np.abs(a.astype(np.float32)).max(initial=0.0))
        for a in golden.values()
        if a.dtype.kind not in "biu"
    ]
    relative = [ACCELERATOR_RELATIVE * x for x in largest if np.isfinite(x)]
    floor = DEFAULT_PRODUCTS_TOLERANCE if matmul_precision == "default" else 0.0
    return max([precision["tolerance"], floor, *relative])


SAMPLING_RULE = (
    "sample_prefill and sample_step return each stream's next token: the argmax of its logits "
    "when temperature is 0; otherwise stream b draws its token at position p (the stream's "
    "count of tokens so far) with the key fold_in(fold_in(key, b), p), from the softmax of its "
    "logits divided by the temperature after top-k, top-p and min-p, as dense_armor's generate"
)


# jax.export's promise: a jax release loads what a jax up to 6 months older serialized.
BACKWARD_COMPATIBILITY_DAYS = 180


def _compatibility(exported: dict[str, export.Exported]) -> dict[str, Any]:
    today = datetime.date.today()
    return {
        "serialization_version": max(e.calling_convention_version for e in exported.values()),
        "exported_with_jax": jax.__version__,
        "exported_on": today.isoformat(),
        "newer_jax_guaranteed_until": (
            today + datetime.timedelta(days=BACKWARD_COMPATIBILITY_DAYS)
        ).isoformat(),
        "note": "jax.export guarantees that a newer jax loads these .jax_exported files for 6 "
        "months after export; after that date a newer jax may refuse them (export again). The "
        "static StableHLO modules follow StableHLO's own compatibility window.",
    }
