"""The attention options, said once: they are the keyword arguments of the attention layers'
constructors (`MultiHeadSelfAttention`'s and `MultiHeadCrossAttention`'s), read from their
signatures. Blocks and factories take them as `**attention` and pass them through, so a new option
of an attention layer needs no change in any block or factory."""

import inspect
from collections.abc import Mapping
from typing import Any

from .self_attention import MultiHeadSelfAttention

__all__ = ["ATTENTION_OPTIONS", "attention_options", "options_of"]


def options_of(layer: type) -> tuple[str, ...]:
    """The keyword options of `layer`'s constructor: its arguments after `key`."""
    names = list(inspect.signature(layer).parameters)
    return tuple(names[names.index("key") + 1 :])


# What a block or a factory passes to its attention layers: every option of the self-attention
# but `causal`, which blocks and factories take themselves (the page's argument).
ATTENTION_OPTIONS = tuple(name for name in options_of(MultiHeadSelfAttention) if name != "causal")


def attention_options(
    owner: str, options: Mapping[str, Any], layer: type = MultiHeadSelfAttention
) -> dict[str, Any]:
    """The `options` that `layer` takes, after checking that each is an attention option
    (`TypeError` naming `owner` and the known options otherwise, as a misspelt keyword would)."""
    unknown = sorted(set(options) - set(ATTENTION_OPTIONS))
    if unknown:
        raise TypeError(
            f"{owner} got unexpected keyword arguments {unknown}; the attention's options are "
            f"{list(ATTENTION_OPTIONS)} (see MultiHeadSelfAttention)."
        )
    accepted = options_of(layer)
    return {name: value for name, value in options.items() if name in accepted}
