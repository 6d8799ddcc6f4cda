"""The model families that checkpoints and the export stage know, in one registry.

A `Family` says everything the rest of dense_armor needs about a kind of model: the factory
that builds it from a config's arguments, the arguments of its causal form (the model whose
step is exported), whether it attends to a context and how wide that is, how its forward is
called, and how its streaming cache starts. `checkpoint.ModelConfig` looks factories up here and
the export stage builds every exported function from these entries: adding a family is adding
one entry to `FAMILIES`.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..nn.models.decoder import transformer_decoder
from ..nn.models.encoder import transformer_encoder
from ..nn.models.language_model import TransformerLM, longrope_limit

__all__ = ["FAMILIES", "Family", "family"]

Arguments = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    - `name`: the factory's name, as configs store it;
    - `factory`: `factory(**arguments, key=key)` builds the model;
    - `kind`: what the artifact calls it (`"encoder"`: one output per sequence; `"decoder"`: one
      per step, attending to a context; `"language_model"`: token ids in, the next token's
      logits at every step out);
    - `causal`: the arguments of the model's causal form, which streams;
    - `context_width`: the width of the context it attends to, or `None`;
    - `apply(model, x, context)`: the forward of one sample, `context` a tuple `(context,
      context_mask)` or `()`;
    - `start(model, capacity, context, on_overflow)`: one stream's empty cache;
    - `token_ids`: its inputs are token ids (int32, one per step, in `[0, vocab)`), not vectors
      of `n_in` features;
    - `default_positions`: the `positions` of a config that does not name them.

    And what the export stage reads of a config's arguments, asked here rather than by name:
    `input_spec` (the dtype and shape of one step's input), `max_length` (the longest sequence
    it takes) and `positions_end` (the step at which its positions stop, so a stream cannot go
    past it: the longest sequence for a positional table, LongRoPE's pretrained length, `None` for
    other rotary positions, none, or a window's unbounded ones).
    """

    name: str
    factory: Callable[..., Any]
    kind: str
    causal: Callable[[Arguments], dict[str, Any]]
    context_width: Callable[[Arguments], int | None]
    apply: Callable[[Any, Any, Sequence[Any]], Any]
    start: Callable[[Any, int, Sequence[Any], str], Any]
    token_ids: bool = False
    default_positions: str = "sinusoidal"

    def input_spec(self, arguments: Arguments) -> tuple[str, tuple[int, ...]]:
        """One step's input: its dtype and shape (`float32 (n_in,)`, or `int32 ()` for ids)."""
        if self.token_ids:
            return "int32", ()
        return "float32", (int(arguments["n_in"]),)

    def vocabulary(self, arguments: Arguments) -> int | None:
        """The number of token ids a family of `token_ids` takes (else `None`)."""
        return int(arguments["vocab"]) if self.token_ids else None

    def max_length(self, arguments: Arguments) -> int:
        """`max_len`, or LongRoPE's pretrained length where that is shorter."""
        limit = self.position_limit(arguments)
        return int(arguments["max_len"]) if limit is None else min(int(arguments["max_len"]), limit)

    def position_limit(self, arguments: Arguments) -> int | None:
        """Where rotary positions end: LongRoPE's pretrained length (`TransformerLM`'s
        `position_limit`), else None."""
        layers = arguments.get("layer_options") or [{}]
        return longrope_limit(arguments, [dict(layer) for layer in layers])

    def positions_end(self, arguments: Arguments) -> int | None:
        positions = arguments.get("positions", self.default_positions)
        if positions == "learned":  # a table of max_len rows, window or not
            return self.max_length(arguments)
        # rotary positions (unless LongRoPE's, which end at its pretrained length), or none, or
        # a window's sinusoids (computed for any step): no end
        if positions in ("rope", "none") or arguments.get("window") is not None:
            return self.position_limit(arguments)
        return self.max_length(arguments)


def _encoder_start(model: Any, capacity: int, context: Sequence[Any], on_overflow: str) -> Any:
    return model.init_cache(capacity, on_overflow=on_overflow)


def _decoder_start(model: Any, capacity: int, context: Sequence[Any], on_overflow: str) -> Any:
    states, mask = context
    return model.init_cache(states, capacity, context_mask=mask, on_overflow=on_overflow)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            name="transformer_encoder",
            factory=transformer_encoder,
            kind="encoder",
            causal=lambda arguments: {**arguments, "causal": True},
            context_width=lambda arguments: None,
            apply=lambda model, x, context: model(x),
            start=_encoder_start,
        ),
        Family(
            name="transformer_decoder",
            factory=transformer_decoder,
            kind="decoder",
            causal=dict,  # a decoder is causal already
            context_width=lambda arguments: int(arguments.get("d_context") or arguments["d_model"]),
            apply=lambda model, x, context: model(x, context[0], context_mask=context[1]),
            start=_decoder_start,
        ),
        Family(
            name="transformer_lm",
            factory=TransformerLM,
            kind="language_model",
            causal=dict,  # causal already
            context_width=lambda arguments: None,
            apply=lambda model, x, context: model(x),
            start=_encoder_start,
            token_ids=True,
            default_positions="rope",
        ),
    )
}


def family(name: str) -> Family:
    """The family of factory `name`; `KeyError` naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown model factory {name!r}; known: {sorted(FAMILIES)}.") from None
