"""How a factory's model places its steps: the positional layer a `positions=` option names, or
the rotary base its attention takes."""

from jaxtyping import PRNGKeyArray

from ..layers.positions import AddPositions, LearnedPositions, PositionalEncoding

__all__ = ["POSITIONS"]


def _positions(
    kind: str, max_len: int, d_model: int, key: PRNGKeyArray, window: int | None
) -> PositionalEncoding | None:
    """The positional layer of `positions=kind`; `None` for rotary ones, which live inside the
    attention, and for `"none"`. A windowed model's sinusoidal positions are unbounded, so it
    streams forever."""
    if kind == "sinusoidal":
        return AddPositions(None if window is not None else max_len)
    if kind == "learned":
        return LearnedPositions(max_len, d_model, key)
    if kind in ("rope", "none"):
        return None
    raise ValueError(f"`positions` must be one of {POSITIONS}; received `positions={kind!r}`.")


POSITIONS = ("sinusoidal", "learned", "rope", "none")


def _rope_base(positions: str, rope_base: float) -> float | None:
    return rope_base if positions == "rope" else None
