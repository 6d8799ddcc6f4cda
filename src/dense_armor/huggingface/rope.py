"""A config's rotary positions as the attention's options (`rope_base`, `rope_scaling`,
`rotary_fraction`), from either spelling of the hub's configs: transformers 5's `rope_parameters`
(one mapping, or one per layer type: Gemma 3's `sliding_attention` and `full_attention`, which
`gemma` derives from Gemma 3's older keys) or the earlier `rope_theta`, `rope_scaling` (`type` or
`rope_type`) and `partial_rotary_factor`. A kind the attention does not build (`dynamic`, or one
unknown) is refused by name."""

import math
from typing import Any

from ..nn.kernels.rotary import check_rope_scaling
from ._files import HuggingFaceError

__all__ = ["LAYER_TYPES", "rotary_options"]

LAYER_TYPES = ("full_attention", "sliding_attention")
_LONG = ("llama3", "yarn", "longrope")  # kinds that carry the pretrained length


def _parameters(config: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The rope mapping that applies to `layer_type`'s layers, merged from either spelling."""
    parameters = config.get("rope_parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise HuggingFaceError(
            f"config.json: `rope_parameters` is {parameters!r}; expected an object."
        )
    nested = any(key in LAYER_TYPES for key in parameters or {})
    if nested:
        values = (parameters or {}).get(layer_type or "full_attention") or {}
        if not isinstance(values, dict):
            raise HuggingFaceError(f"config.json: `rope_parameters[{layer_type!r}]` is {values!r}.")
        return dict(values)
    scaling = config.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise HuggingFaceError(f"config.json: `rope_scaling` is {scaling!r}; expected an object.")
    scaling = dict(scaling)
    if "type" in scaling:  # the older key
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {
        **dict(parameters or {}),
        **scaling,
    }  # a config's `rope_scaling` wins, as in transformers


def rotary_options(
    config: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0
) -> dict[str, Any]:
    """`rope_base`, `rope_scaling` (or None) and `rotary_fraction` for `layer_type`'s layers."""
    values = _parameters(config, layer_type)
    # the pretrained length: read always, used by the kinds that scale past it
    original = config.get("original_max_position_embeddings")
    kind = values.pop("rope_type", values.pop("type", "default"))
    theta = values.pop("rope_theta", config.get("rope_theta", default_theta))
    fraction = values.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta):
        raise HuggingFaceError(f"config.json: `rope_theta` is {theta!r}; expected a number.")
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise HuggingFaceError(f"config.json: `partial_rotary_factor` is {fraction!r}.")
    options: dict[str, Any] = {"rope_base": float(theta)}
    if fraction != 1.0:
        options["rotary_fraction"] = float(fraction)
    if kind == "default":
        if values:
            raise HuggingFaceError(
                f"config.json: rope options {sorted(values)} beside the default rope type are not "
                "implemented by TransformerLM; refusing rather than ignoring them."
            )
        return options
    if kind in _LONG:
        values.setdefault("original_max_position_embeddings", original)
        if values["original_max_position_embeddings"] is None:
            values["original_max_position_embeddings"] = config.get("max_position_embeddings")
    if (
        kind in ("yarn", "longrope")
        and values.get("factor") is None
        and values.get("original_max_position_embeddings")
    ):
        values["factor"] = (
            config["max_position_embeddings"] / values["original_max_position_embeddings"]
        )
    try:
        options["rope_scaling"] = dict(check_rope_scaling({"rope_type": kind, **values}) or ())
    except ValueError as error:
        raise HuggingFaceError(
            f"config.json: the rope scaling ({kind!r}) cannot be built: {error} Refusing rather "
            "than ignoring it."
        ) from None
    return options
