"""`TransformerLM`'s per-model and per-layer options, checked: the final soft-cap, LongRoPE's
pretrained length, each block's mixer and each block's own attention options."""

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..blocks.recurrent_block import MIXERS
from ..core import require_choice
from ..kernels.rotary import check_rope_scaling
from ..mixers.options import attention_options

__all__ = [
    "check_softcap", "context_length", "layer_options_checked", "longrope_limit", "mixer_kinds",
]  # fmt: skip


def check_softcap(cap: Any) -> float | None:
    if cap is None:
        return None
    real = isinstance(cap, numbers.Real) and not isinstance(cap, bool | np.bool_)
    if not real or not math.isfinite(cap) or cap <= 0:
        raise ValueError(
            f"`final_logit_softcap` must be a positive finite number or None; received {cap!r}."
        )
    return float(cap)


def longrope_limit(
    options: Mapping[str, Any], per_layer: Sequence[Mapping[str, Any]]
) -> int | None:
    """The smallest pretrained length of the blocks' LongRoPE scalings (`Rotary.position_limit`),
    or None: where the model's positions end."""
    limits = [
        int(dict(scaling)["original_max_position_embeddings"])
        for layer in per_layer
        if (scaling := check_rope_scaling({**options, **layer}.get("rope_scaling")))
        and dict(scaling)["rope_type"] == "longrope"
    ]
    return min(limits, default=None)


def context_length(
    max_len: int, options: Mapping[str, Any], per_layer: Sequence[Mapping[str, Any]]
) -> int:
    """The most positions the model was made for: `max_len` (a checkpoint's
    `max_position_embeddings`), or the longer context a YaRN scaling stretches its pretrained
    length to (`factor` times `original_max_position_embeddings`), or LongRoPE's pretrained
    length where the model's positions end (`longrope_limit`)."""
    limit = longrope_limit(options, per_layer)
    if limit is not None:
        return min(int(max_len), limit)
    stretched = [
        int(float(scaling["factor"]) * int(scaling["original_max_position_embeddings"]))
        for layer in per_layer
        if (found := check_rope_scaling({**options, **layer}.get("rope_scaling")))
        and (scaling := dict(found))["rope_type"] == "yarn"
        and scaling.get("original_max_position_embeddings")
    ]
    return max([int(max_len), *stretched])


def mixer_kinds(
    mixers: Sequence[str] | None,
    options: Mapping[str, Mapping[str, Any]] | None,
    depth: int,
    per_layer: Sequence[Mapping[str, Any]],
) -> list[str]:
    """Each block's mixer, checked: `"attention"` or a `RecurrentBlock` mixer (`MIXERS`), with
    the options of each recurrent kind used (`mixer_options[kind]`, a mapping) and no attention
    options of its own."""
    kinds = ["attention"] * depth if mixers is None else mixers
    if isinstance(kinds, str | bytes) or not isinstance(kinds, Sequence) or len(kinds) != depth:
        raise ValueError(
            f"`mixers` must be a sequence of {depth} names (one per block); received {mixers!r}."
        )
    known = ("attention", *MIXERS)
    for i, kind in enumerate(kinds):
        require_choice(f"mixers[{i}]", kind, known)
        if kind != "attention" and per_layer[i]:
            raise ValueError(
                f"`layer_options[{i}]` sets attention options on a {kind} block: give them to "
                "the attention blocks only (an empty mapping for the others)."
            )
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"`mixer_options` must be a mapping by mixer; received {options!r}.")
    for kind in set(kinds) - {"attention"}:
        if not isinstance((options or {}).get(kind, {}), Mapping):
            raise TypeError(f"`mixer_options[{kind!r}]` must be a mapping of the mixer's options.")
    unused = set(options or {}) - set(kinds)
    if unused:
        raise ValueError(f"`mixer_options` for mixers no block uses: {sorted(unused)}.")
    return list(kinds)


def layer_options_checked(
    layer_options: Sequence[Mapping[str, Any]] | None, depth: int, positions: str
) -> list[dict[str, Any]]:
    """Each block's own attention options (over the model's), checked: one mapping per block, each
    of attention options (Gemma's sliding and global layers: `window` and `rope_base` apart)."""
    if layer_options is None:
        return [{} for _ in range(depth)]
    if isinstance(layer_options, str | bytes | Mapping) or not isinstance(layer_options, Sequence):
        raise TypeError(
            f"`layer_options` must be a sequence of {depth} mappings (one per block); received "
            f"{type(layer_options).__name__}."
        )
    if len(layer_options) != depth:
        raise ValueError(
            f"`layer_options` must hold one mapping per block ({depth}); received "
            f"{len(layer_options)}."
        )
    out = []
    for i, layer in enumerate(layer_options):
        if not isinstance(layer, Mapping):
            raise TypeError(f"`layer_options[{i}]` must be a mapping; received {layer!r}.")
        layer = attention_options(f"TransformerLM layer_options[{i}]", layer)
        if positions != "rope" and "rope_base" in layer:
            raise ValueError(f"`layer_options[{i}]` sets `rope_base` on a model without rotary.")
        out.append(dict(layer))
    return out
