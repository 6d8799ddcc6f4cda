"""Rotary position embedding (Su et al. 2021, "RoFormer"): queries and keys rotated by their
step index, so that their dot product depends only on how far apart the steps are.

The convention is that of GPT-NeoX, Llama and Equinox's `RotaryPositionalEmbedding` ("rotate
half"): in a head of `d_head` features, feature `i` and feature `i + d_head / 2` rotate together,
by the angle `position * base ** (-2 i / d_head)`, for `i < d_head / 2`. (The RoPE paper pairs
neighbouring features `2i` and `2i + 1` instead: the same function of a permuted head.)

`Rotary` adds what the checkpoints of 2024-2026 carry, with transformers' formulas
(`modeling_rope_utils`): a partial rotation (`fraction`: only the first `fraction * d_head`
features rotate, as in Phi-3/4 and StarCoder-like models; the rest pass through), and a scaling of
the frequencies for contexts longer than the pretrained one: `linear` (every frequency divided
by `factor`), `llama3` (Llama 3.1-3.3: low frequencies divided by `factor`, high ones kept, a
smooth ramp between, by wavelength against `original_max_position_embeddings`) and `yarn` (Peng
et al. 2023: a ramp between interpolated and extrapolated frequencies over the dimensions, and
cos and sin multiplied by an attention factor, `0.1 ln(factor) + 1` unless the config gives it)
and `longrope` (Phi-3.5/Phi-4-mini: each frequency divided by its own entry of `short_factor`, cos
and sin multiplied by `sqrt(1 + ln(factor) / ln(original))`), within its pretrained length only.
transformers switches a call to the `long_factor` list when the call reaches past
`original_max_position_embeddings`, so the hidden states of a prompt depend on how it was cut
into calls (a stream that crosses that length is neither the forward over it nor the same stream
cut elsewhere): a model with LongRoPE here ends its positions at that length (`position_limit`:
its streams count their steps and overflow there, a longer forward is refused), where it is
exactly transformers'.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["ROPE_SCALINGS", "Rotary", "check_rope_scaling", "rotate"]

# The scaling kinds built, and for each the keys it takes (beside `rope_type`).
ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
        "beta_slow", "mscale", "mscale_all_dim", "truncate",
    ),
    "longrope": (
        "short_factor", "long_factor", "factor", "original_max_position_embeddings",
        "attention_factor",
    ),
}  # fmt: skip
_LISTS = ("short_factor", "long_factor")
_REQUIRED = {
    "linear": ("factor",),
    "llama3": ROPE_SCALINGS["llama3"],
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings"),
}
# A kind that transformers has and this module refuses by name: `dynamic` recomputes its NTK base
# from each call's length (a continuum of frequencies, not two fixed tables).
REFUSED_SCALINGS = {
    "dynamic": "NTK scaling recomputed from each call's length",
}


def check_rope_scaling(scaling: Any) -> tuple[tuple[str, Any], ...] | None:
    """`rope_scaling` (a mapping with `rope_type` and that kind's keys, or `None`) as a sorted
    tuple of items (hashable: a layer's static field); `ValueError` naming what is wrong."""
    if scaling is None:
        return None
    items = dict(scaling) if isinstance(scaling, Mapping) else None
    if items is None and isinstance(scaling, tuple):
        items = dict(scaling)
    if items is None:
        raise ValueError(f"`rope_scaling` must be a mapping or None; received {scaling!r}.")
    kind = items.pop("rope_type", None)
    if kind in REFUSED_SCALINGS:
        raise ValueError(
            f"`rope_scaling` of type {kind!r} ({REFUSED_SCALINGS[kind]}) is not built; "
            f"the built kinds are {sorted(ROPE_SCALINGS)}."
        )
    if kind not in ROPE_SCALINGS:
        raise ValueError(
            f"`rope_scaling['rope_type']` must be one of {sorted(ROPE_SCALINGS)}; received "
            f"{kind!r}."
        )
    unknown = sorted(set(items) - set(ROPE_SCALINGS[kind]))
    missing = [name for name in _REQUIRED[kind] if items.get(name) is None]
    if unknown or missing:
        raise ValueError(
            f"`rope_scaling` of type {kind!r} takes {list(ROPE_SCALINGS[kind])} (required: "
            f"{list(_REQUIRED[kind])}); received unknown {unknown}, missing {missing}."
        )
    for name in _LISTS:
        if name in items:
            items[name] = _factor_list(name, items[name])
    for name, value in items.items():
        if name in _LISTS:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if name == "truncate" and not isinstance(value, bool):
            raise ValueError(f"`rope_scaling['truncate']` must be a bool; received {value!r}.")
        if name != "truncate" and value is not None and not (number and math.isfinite(value)):
            raise ValueError(f"`rope_scaling[{name!r}]` must be a number; received {value!r}.")
        if name != "truncate" and number and value <= 0:
            raise ValueError(f"`rope_scaling[{name!r}]` must be positive; received {value!r}.")
    return tuple(sorted({"rope_type": kind, **items}.items()))


def _factor_list(name: str, value: Any) -> tuple[float, ...]:
    """LongRoPE's `short_factor` or `long_factor`: a non-empty list of positive numbers."""
    good = isinstance(value, list | tuple) and len(value) > 0
    numbers = good and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        for v in value
    )
    if not numbers:
        raise ValueError(
            f"`rope_scaling[{name!r}]` must be a list of positive numbers, one per rotated pair "
            f"of features; received {value!r}."
        )
    return tuple(float(v) for v in value)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """The rotation of one attention layer: `base`, the head width `d_head`, the rotated
    `fraction` of it and the `scaling` (`check_rope_scaling`'s items, or `None`)."""

    base: float
    d_head: int
    fraction: float = 1.0
    scaling: tuple[tuple[str, Any], ...] | None = None

    @property
    def dims(self) -> int:
        """The rotated features: `int(d_head * fraction)`, as transformers truncates it."""
        return int(self.d_head * self.fraction)

    def frequencies(self) -> tuple[np.ndarray | None, float]:
        """The inverse frequencies `(dims / 2,)` (float32; `None` for the unscaled ones, computed
        in the graph as before) and the factor on cos and sin (`longrope`: the short factors')."""
        if self.scaling is None:
            return None, 1.0
        s = dict(self.scaling)
        dim = self.dims
        exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        powers = np.float32(self.base) ** exponents  # float32, as transformers computes them
        inv = (1.0 / powers).astype(np.float32)
        kind = s["rope_type"]
        if kind == "linear":
            return (inv / np.float32(s["factor"])).astype(np.float32), 1.0
        if kind == "llama3":
            return _llama3(inv, s), 1.0
        if kind == "longrope":
            return _longrope(powers, s)
        return _yarn(powers, dim, self.base, s)

    def __call__(self, x: Array, positions: Array) -> Array:
        return rotate(x, positions, self.base, rotary=self)


def _longrope(powers: np.ndarray, s: dict[str, Any]) -> tuple[np.ndarray, float]:
    """LongRoPE's frequencies within the pretrained length and its attention factor
    (transformers' `_compute_longrope_parameters` without `seq_len`): `1 / (short_i * base **
    (2i / dims))`, and `sqrt(1 + ln(factor) / ln(original))`."""
    for name in ("short_factor", "long_factor"):
        if len(s[name]) != powers.size:
            raise ValueError(
                f"`rope_scaling[{name!r}]` has {len(s[name])} entries; the layer rotates "
                f"{powers.size} pairs of features."
            )
    factors = np.asarray(s["short_factor"], np.float32)
    inv = (1.0 / (factors * powers)).astype(np.float32)
    attention = s.get("attention_factor")
    if attention is None:
        factor, original = s["factor"], s["original_max_position_embeddings"]
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv, float(attention)


def _llama3(inv: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's frequencies (transformers' `_compute_llama3_parameters`)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelength = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelength > old / low, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((old / wavelength - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelength < old / high) & ~(wavelength > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(powers: np.ndarray, dim: int, base: float, s: dict[str, Any]) -> tuple[np.ndarray, float]:
    """YaRN's frequencies and attention factor (transformers' `_compute_yarn_parameters`)."""
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(s.get("beta_fast") or 32), correction(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extrapolated, inv_interpolated = 1.0 / powers, 1.0 / (np.float32(factor) * powers)
    inv = inv_interpolated * (1 - extrapolation) + inv_extrapolated * extrapolation
    return inv.astype(np.float32), float(attention)


def rotate(
    x: Float[Array, "*heads L d_head"],
    positions: Int[Array, " L"],
    base: float = 10000.0,
    *,
    rotary: Rotary | None = None,
) -> Float[Array, "*heads L d_head"]:
    """`x` rotated by `positions (L,)`, in float32, returned in the dtype of `x`; `rotary` (if
    given) says which features rotate and how the frequencies are scaled."""
    dims = x.shape[-1] if rotary is None else rotary.dims
    inverse, factor = (None, 1.0) if rotary is None else rotary.frequencies()
    half = dims // 2
    if inverse is None:
        frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / dims)
    else:
        frequencies = jnp.asarray(inverse)
    angles = positions.astype(jnp.float32)[:, None] * frequencies[None, :]  # (L, half)
    leading = (1,) * (x.ndim - 2)  # explicit: no implicit rank promotion
    shape = (*leading, x.shape[-2], dims)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1).reshape(shape)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1).reshape(shape)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    x32 = x.astype(jnp.float32)
    turned, passed = x32[..., :dims], x32[..., dims:]
    rotated_half = jnp.concatenate([-turned[..., half:], turned[..., :half]], axis=-1)
    out = turned * cos + rotated_half * sin
    if passed.shape[-1]:
        out = jnp.concatenate([out, passed], axis=-1)
    return out.astype(x.dtype)
