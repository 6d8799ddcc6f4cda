"""Penalties: a stream's logits changed by what it has seen, before the sampling rules
(`nn.sampling`), greedy included.

Penalties (`Penalties`, checked by `check_penalties`) follow vLLM's and OpenAI's formulas, in
vLLM's order: first `logit_bias` (a number added to chosen tokens' logits), then
`repetition_penalty` `r` over the tokens of the prompt and of the output (a positive logit
divided by `r`, any other multiplied), then `frequency_penalty` `f` and `presence_penalty` `p`
over the output's (`logit -= f * count + p * (count > 0)`). A row's history (`History`: each
token's count in its output, whether it is in its prompt, its bias and settings) stays on the
device; `penalised` reads it, `counted` adds each drawn token. The log-probabilities a request
asks for are the model's, before any of them.
"""

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .sampling import _real

__all__ = [
    "MAX_LOGIT_BIAS",
    "History",
    "PenaltyError",
    "Penalties",
    "check_penalties",
    "counted",
    "history",
    "allowed_tokens",
    "history_row",
    "mask_words",
    "penalised",
]


MAX_LOGIT_BIAS = 1024  # entries of one request's `logit_bias`


class Penalties(NamedTuple):
    """A stream's penalties (off by default): `presence` and `frequency` (OpenAI's, numbers in
    `[-2, 2]`), `repetition` (vLLM's, a number `> 0`; 1 is off) and `logit_bias` (token id ->
    a number in `[-100, 100]`, at most `MAX_LOGIT_BIAS` of them)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # or a mapping, made pairs when checked

    @property
    def on(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1 or self.logit_bias)


class PenaltyError(ValueError):
    """A penalty out of its range; `field`: its name in OpenAI's API (`presence_penalty`, ...)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_penalties(penalties: Any, vocab: int) -> Penalties:
    """`penalties` (a `Penalties`, or None for off) checked, each setting refused by name out of
    its range; `logit_bias`'s ids inside the vocabulary."""
    if penalties is None:
        return Penalties()
    if not isinstance(penalties, Penalties):
        raise TypeError(f"`penalties` must be a `Penalties`; received {type(penalties).__name__}.")
    for name, low in (("presence", -2.0), ("frequency", -2.0)):
        value = getattr(penalties, name)
        if not _real(value) or not low <= value <= 2.0:
            raise PenaltyError(
                f"`{name}_penalty` must be a number in [-2, 2]; received {value!r}.",
                f"{name}_penalty",
            )
    r = penalties.repetition
    if not _real(r) or not np.isfinite(r) or r <= 0:
        raise PenaltyError(
            f"`repetition_penalty` must be a finite number > 0; received {r!r}.",
            "repetition_penalty",
        )
    bias = _bias_pairs(penalties.logit_bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise PenaltyError(
            f"`logit_bias` has {len(bias)} entries; at most {MAX_LOGIT_BIAS}.", "logit_bias"
        )
    ids = [t for t, _ in bias]
    for token, value in bias:
        if (
            not isinstance(token, Integral)
            or isinstance(token, bool)
            or not 0 <= int(token) < vocab
        ):
            raise PenaltyError(
                f"`logit_bias`: token {token!r} is not an id in [0, {vocab}).", "logit_bias"
            )
        if not _real(value) or not -100.0 <= value <= 100.0:
            raise PenaltyError(
                f"`logit_bias`: {value!r} for token {token} is not in [-100, 100].", "logit_bias"
            )
    if len(set(ids)) != len(ids):
        raise PenaltyError("`logit_bias` names a token more than once.", "logit_bias")
    return penalties._replace(logit_bias=tuple((int(t), float(v)) for t, v in bias))


def _bias_pairs(bias: Any) -> tuple[tuple[Any, Any], ...]:
    """`logit_bias` as `(token, value)` pairs: from pairs, or from a mapping of ids to values."""
    if isinstance(bias, Mapping):
        return tuple(bias.items())
    if isinstance(bias, str | bytes) or not isinstance(bias, Sequence):
        raise ValueError(
            f"`logit_bias` must be (token, value) pairs or a mapping; received {bias!r}."
        )
    if not all(isinstance(pair, Sequence) and len(pair) == 2 for pair in bias):
        raise PenaltyError(
            f"`logit_bias` must be (token, value) pairs; received {bias!r}.", "logit_bias"
        )
    return tuple((pair[0], pair[1]) for pair in bias)


class History(NamedTuple):
    """What the penalties of `S` streams read, on the device: `counts (S, vocab)` each token's
    count in a stream's output, `seen (S, vocab)` whether it is in its prompt, `bias (S, vocab)`
    its logit bias, `settings (S, 3)` its presence, frequency and repetition penalties, and
    `active (S,)` whether it has any (a row without them is left bit for bit as it was); and
    where a grammar constrains a stream's next token (a server's history only), `allowed (S,
    ceil(vocab / 32))` int32, bit `t % 32` of word `t // 32` set for each token it allows, and
    `masked (S,)` whether it has one (a token it does not allow gets a logit of `-inf`)."""

    counts: Array
    seen: Array
    bias: Array
    settings: Array
    active: Array
    allowed: Array | None = None
    masked: Array | None = None


def history(streams: int, vocab: int) -> History:
    """The history of `streams` streams without penalties or grammars."""
    return History(
        jnp.zeros((streams, vocab), jnp.int32), jnp.zeros((streams, vocab), bool),
        jnp.zeros((streams, vocab), jnp.float32),
        jnp.tile(jnp.array([0.0, 0.0, 1.0], jnp.float32), (streams, 1)),
        jnp.zeros((streams,), bool), jnp.full((streams, mask_words(vocab)), -1, jnp.int32),
        jnp.zeros((streams,), bool),
    )  # fmt: skip


def mask_words(vocab: int) -> int:
    """The int32 words of a token mask over `vocab` tokens (32 tokens a word)."""
    return -(-vocab // 32)


def allowed_tokens(words: Array, vocab: int) -> Array:
    """The tokens a mask's `words (..., ceil(vocab / 32))` allow, `(..., vocab)` bool."""
    shifts = jnp.arange(32, dtype=jnp.int32).reshape((1,) * words.ndim + (32,))
    bits = (words[..., None] >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab].astype(bool)


def history_row(
    penalties: Penalties, vocab: int, prompt: Any, output: Any = ()
) -> tuple[np.ndarray, ...]:
    """One stream's row of a `History` (NumPy, `History`'s order): its `output` tokens' counts,
    its `prompt`'s tokens seen, its bias, its settings and whether any is on."""
    counts = np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.int32)
    seen = np.zeros(vocab, bool)
    seen[np.asarray(prompt, np.int64)] = True
    bias = np.zeros(vocab, np.float32)
    for token, value in penalties.logit_bias:
        bias[token] = value
    settings = np.array([penalties.presence, penalties.frequency, penalties.repetition], np.float32)
    return counts, seen, bias, settings, np.array(penalties.on)


def penalised(logits: Float[Array, "B vocab"], past: History, rows: Any) -> Array:
    """The logits `(B, vocab)`, float32, of the streams `rows (B,)` of `past` after their
    penalties (the module's formulas), then their grammars' masks; each computed only when one
    of them has any."""
    logits = _penalties(logits.astype(jnp.float32), past, rows)
    if past.allowed is None or past.masked is None:
        return logits
    allowed, masked = past.allowed, past.masked

    def mask(logits: Array) -> Array:
        hidden = masked[rows][:, None] & ~allowed_tokens(allowed[rows], logits.shape[-1])
        return jnp.where(hidden, -jnp.inf, logits)

    return jax.lax.cond(jnp.any(masked[rows]), mask, lambda x: x, logits)


def _penalties(logits: Array, past: History, rows: Any) -> Array:

    def apply(logits: Array) -> Array:
        counts, active = past.counts[rows], past.active[rows][:, None]
        presence, frequency, repetition = (past.settings[rows, j][:, None] for j in range(3))
        out = logits + past.bias[rows]
        repeated = past.seen[rows] | (counts > 0)
        scaled = jnp.where(out > 0, out / repetition, out * repetition)
        out = jnp.where(repeated, scaled, out)
        used = counts.astype(jnp.float32)
        out = out - frequency * used - presence * (counts > 0).astype(jnp.float32)
        return jnp.where(active, out, logits)

    return jax.lax.cond(jnp.any(past.active[rows]), apply, lambda x: x, logits)


def counted(past: History, rows: Any, chosen: Any, new: Any = True) -> History:
    """`past` with each stream `rows[b]`'s `chosen[b]` counted in its output (where `new`; and
    only for a stream with penalties, whose counts are read)."""
    add = (past.active[rows] & new).astype(jnp.int32)

    def count(counts: Array) -> Array:
        return counts.at[rows, chosen].add(add, mode="promise_in_bounds")

    return past._replace(counts=jax.lax.cond(jnp.any(add), count, lambda c: c, past.counts))
