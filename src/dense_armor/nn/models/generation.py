"""`generate`: token generation from a `TransformerLM` in one compiled function: the prompts'
common length in one `prefill`, then a `jax.lax.while_loop` of `step`s over a fixed cache, every
prompt its own stream (its own positions), sampling in the loop with the rules of
`dense_armor.nn.sampling`. A step runs only while a row has tokens to come: the last token is
drawn and never fed back, so one new token costs the prefill alone."""

import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..core import require_int, require_key
from ..layers.language import ids_checked
from ..penalties import History, Penalties, check_penalties, counted, history_row, penalised
from ..precision import KV_DTYPES
from ..sampling import check_sampling, draw_tokens
from ..sharding import check_serving_mesh, laid_out, on_mesh, place_model, shard_caches
from .language_model import TransformerLM

__all__ = ["Generation", "generate", "stream_tokens"]


class Generation(NamedTuple):
    """What `generate` returns: `tokens (B, max_new_tokens)` int32, each row's new tokens then
    `-1` where it stopped early, and `lengths (B,)`, how many each row generated (a stop token
    included)."""

    tokens: jax.Array
    lengths: jax.Array


def _prompts(
    model: TransformerLM, prompts: Any, caller: str = "generate"
) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as a padded `(B, P)` int32 array and their lengths, checked: a list of id
    sequences (of any lengths) or a 2-D integer array (every row whole)."""
    if not isinstance(model, TransformerLM):
        raise TypeError(
            f"{caller}: `model` must be a TransformerLM; received {type(model).__name__}."
        )
    if isinstance(prompts, np.ndarray | jax.Array) and np.ndim(prompts) == 2:
        rows = list(np.asarray(prompts))
    elif isinstance(prompts, Sequence) and not isinstance(prompts, str) and prompts:
        rows = [np.asarray(p) for p in prompts]
    else:
        raise ValueError(
            f"{caller}: `prompts` must be a non-empty list of token id sequences or a 2-D integer "
            f"array; received {type(prompts).__name__}."
        )
    for i, row in enumerate(rows):
        if row.ndim != 1 or not (np.issubdtype(row.dtype, np.integer) or row.size == 0):
            raise ValueError(
                f"{caller}: prompt {i} must be a 1-D sequence of integer token ids; received "
                f"shape {row.shape} dtype {row.dtype}."
            )
        if row.size == 0:
            raise ValueError(f"{caller}: prompt {i} is empty; a prompt needs at least one token.")
        outside = (row < 0) | (row >= model.vocab)
        if outside.any():
            raise ValueError(
                f"{caller}: prompt {i} holds token id {int(row[outside][0])}, outside the "
                f"vocabulary [0, {model.vocab})."
            )
    lengths = np.array([len(r) for r in rows], np.int32)
    padded = np.zeros((len(rows), int(lengths.max())), np.int32)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return padded, lengths


def generate(
    model: TransformerLM,
    prompts: Any,
    max_new_tokens: int,
    key: jax.Array | None = None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    capacity: int | None = None,
    kv_dtype: str | None = None,
    penalties: Penalties | None = None,
    mesh: Any = None,
) -> Generation:
    """Generate up to `max_new_tokens` tokens after each prompt, in one compiled function.

    **Arguments:** `model`, `prompts` (a list of token id sequences, of any lengths, or a 2-D
    integer array), `max_new_tokens`, `key` (needed unless `temperature=0`, greedy, the
    default); the sampling rules `temperature`, `top_k`, `top_p`, `min_p` (see
    `dense_armor.nn.sampling`); `stop_tokens`: a row stops after generating one of them;
    `capacity`: the cache's slots per row (default: the longest prompt plus `max_new_tokens`);
    `kv_dtype`: the cache's keys and values in another dtype (`"int8"`, `"bfloat16"`, ...: see
    `TransformerLM.init_cache`); `penalties` (`nn.penalties.Penalties`: presence, frequency and
    repetition penalties, a logit bias), applied to every row's logits before the rules, each
    row's from its own prompt and output; `mesh`: a `jax.sharding.Mesh` whose `"model"` axis
    splits the model's heads and hidden units and the cache's key/value heads over its devices
    (`distributed.device_mesh(model=N)`; see `nn.sharding`), the same tokens as on one device.

    Row `b` draws its token at position `p` with `fold_in(fold_in(key, b), p)`, so the same key
    gives the same tokens. Each row is its own stream: greedy generation of a prompt in a batch
    equals its generation alone. The function compiles once per prompt shape and settings.
    """
    padded, lengths = _prompts(model, prompts)
    capacity = _check_generation(
        model, padded.shape[1], max_new_tokens, key, temperature, top_k, top_p, min_p,
        stop_tokens, capacity,
    )  # fmt: skip
    stops = tuple(int(t) for t in stop_tokens)
    check_kv_dtype("generate", kv_dtype)
    penalties = check_penalties(penalties, model.vocab)
    mesh = check_serving_mesh("generate", mesh)
    settings = (int(max_new_tokens), float(temperature), top_k, top_p, min_p, stops, capacity)
    run = _compiled(*settings, kv_dtype, penalties if penalties.on else None)
    model = place_model(model, mesh)
    key = jax.random.PRNGKey(0) if key is None else key
    common = int(lengths.min())  # static: one compilation per common length
    # the prompts were checked above: no callback, so the compilation keeps
    with ids_checked(), on_mesh(mesh):
        return run(model, jnp.asarray(padded), jnp.asarray(lengths), key, common)


def _check_generation(
    model: TransformerLM,
    longest: int,
    max_new_tokens: Any,
    key: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    min_p: Any,
    stop_tokens: Sequence[int],
    capacity: Any,
) -> int:
    """`generate`'s settings checked; the cache's capacity."""
    require_int(1, caller="generate", max_new_tokens=max_new_tokens)
    check_sampling(temperature, top_k, top_p, min_p)
    if temperature != 0:
        require_key(key)
    check_stop_tokens("generate", model, stop_tokens)
    needed = longest + int(max_new_tokens)
    capacity = needed if capacity is None else capacity
    require_int(1, caller="generate (or None)", capacity=capacity)
    if capacity < needed:
        raise ValueError(
            f"generate: the longest prompt ({longest} tokens) and `max_new_tokens="
            f"{max_new_tokens}` need {needed} cache slots; `capacity={capacity}`."
        )
    context = model.context
    if needed > context:
        raise ValueError(
            f"generate: the longest prompt ({longest} tokens) and `max_new_tokens="
            f"{max_new_tokens}` need {needed} positions; the model is made for {context} (its "
            "context: `max_len`, an imported checkpoint's max_position_embeddings, or LongRoPE's "
            "pretrained length)."
        )
    return int(capacity)


def check_kv_dtype(caller: str, kv_dtype: Any) -> None:
    """`kv_dtype` one of `precision.KV_DTYPES` or None, or a `ValueError` naming `caller`."""
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES):
        raise ValueError(
            f"{caller}: `kv_dtype` must be one of {KV_DTYPES} or None; received {kv_dtype!r}."
        )


def check_stop_tokens(caller: str, model: TransformerLM, stop_tokens: Any) -> tuple[int, ...]:
    """`stop_tokens` as a tuple of ids of the model's vocabulary, or a `ValueError`."""
    if isinstance(stop_tokens, str) or not isinstance(stop_tokens, Sequence | np.ndarray):
        raise ValueError(
            f"{caller}: `stop_tokens` must be a list of token ids; received "
            f"{type(stop_tokens).__name__}."
        )
    stops = tuple(stop_tokens)
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in stops):
        raise ValueError(f"{caller}: `stop_tokens` must be integer token ids; received {stops!r}.")
    stops = tuple(int(t) for t in stops)
    if any(not 0 <= t < model.vocab for t in stops):
        raise ValueError(f"{caller}: `stop_tokens` {stops} must lie in [0, {model.vocab}).")
    return stops


@eqx.filter_jit
@laid_out
def _prefill(model: TransformerLM, ids: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    return model.prefill_last(ids, cache)


@eqx.filter_jit
@laid_out
def _step(model: TransformerLM, token: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    return model.step(token, cache)


def stream_tokens(
    model: TransformerLM,
    prompt: Sequence[int],
    max_new_tokens: int,
    key: jax.Array | None = None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    kv_dtype: str | None = None,
    penalties: Penalties | None = None,
    mesh: Any = None,
) -> Iterator[int]:
    """The new tokens of one prompt, each as soon as it is chosen (for a person reading them):
    one compiled `prefill`, then one compiled `step` per token. The same tokens as
    `generate([prompt], ...)` with the same settings, penalties, key and `mesh`; the iterator
    ends after a stop token or `max_new_tokens`."""
    padded, _ = _prompts(model, [prompt])
    capacity = _check_generation(
        model, padded.shape[1], max_new_tokens, key, temperature, top_k, top_p, min_p,
        stop_tokens, None,
    )  # fmt: skip
    check_kv_dtype("stream_tokens", kv_dtype)
    penalties = check_penalties(penalties, model.vocab)
    mesh = check_serving_mesh("stream_tokens", mesh)
    choose = _chooser(float(temperature), top_k, top_p, min_p)
    key = jax.random.PRNGKey(0) if key is None else key
    model = place_model(model, mesh)
    cache = shard_caches(model.init_cache(capacity, on_overflow="nan", kv_dtype=kv_dtype), mesh)
    with ids_checked(), on_mesh(mesh):
        logits, cache = _prefill(model, jnp.asarray(padded[0]), cache)
    position = padded.shape[1]
    past = None
    if penalties.on:
        past = _history(penalties, jnp.asarray(padded), jnp.asarray([padded.shape[1]]), logits)
    for made in range(int(max_new_tokens)):
        row = logits[None] if past is None else _penalised_one(logits[None], past)
        token = int(choose(row, key, jnp.int32(position))[0])
        past = None if past is None else _counted_one(past, jnp.int32(token))
        yield token
        if token in stop_tokens or made + 1 == max_new_tokens:
            return
        with ids_checked(), on_mesh(mesh):
            logits, cache = _step(model, jnp.int32(token), cache)
        position += 1


@jax.jit
def _penalised_one(logits: jax.Array, past: History) -> jax.Array:
    return penalised(logits, past, jnp.zeros(1, jnp.int32))


@jax.jit
def _counted_one(past: History, token: jax.Array) -> History:
    return counted(past, jnp.zeros(1, jnp.int32), token[None])


@functools.cache
def _chooser(
    temperature: float, top_k: int | None, top_p: float | None, min_p: float | None
) -> Any:
    """The next token of each row of `logits (B, vocab)` at `position`: `draw_tokens`, row `b`
    being stream `b`."""

    @jax.jit
    def choose(logits: jax.Array, key: jax.Array, position: jax.Array) -> jax.Array:
        rows = jnp.arange(logits.shape[0])
        positions = jnp.full(logits.shape[0], position, jnp.int32)
        return draw_tokens(
            logits, key, rows, positions, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p,
        )  # fmt: skip

    return choose


@functools.cache
def _compiled(
    max_new: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    stops: tuple[int, ...],
    capacity: int,
    kv_dtype: str | None,
    penalties: Penalties | None,
) -> Any:
    """The compiled generation for these settings (one per distinct settings), its caches laid
    out on the current mesh (`on_mesh`), if any."""

    choose = functools.partial(_choose, _chooser(temperature, top_k, top_p, min_p))

    @eqx.filter_jit
    def run(
        model: TransformerLM, prompts: jax.Array, lengths: jax.Array, key: jax.Array, common: int
    ) -> Generation:
        batch, longest = prompts.shape
        rows = jnp.arange(batch)
        caches = model.init_streams(batch, capacity, on_overflow="nan", kv_dtype=kv_dtype)
        caches = shard_caches(caches)
        # The prompts' common length in one prefill; the loop feeds the rest of each prompt.
        logits, caches = jax.vmap(model.prefill_last)(prompts[:, :common], caches)
        stop_ids = jnp.asarray(stops or (-1,), jnp.int32)

        def draw(position: jax.Array, logits: jax.Array, chosen_so_far: tuple) -> tuple:
            """The token at `position` (the prompt's, or drawn from `logits`), recorded."""
            out, made, done, past = chosen_so_far
            chosen = choose(logits, past, position, key)  # they predict `position`'s token
            in_prompt = position < lengths
            token = jnp.where(in_prompt, prompts[:, jnp.minimum(position, longest - 1)], chosen)
            new = ~in_prompt & ~done
            slot = jnp.minimum(made, max_new - 1)
            out = out.at[rows, slot].set(jnp.where(new, chosen, out[rows, slot]))
            made = made + new.astype(jnp.int32)
            stopped = new & jnp.any(chosen[:, None] == stop_ids[None, :], axis=1)
            past = None if past is None else counted(past, rows, chosen, new)
            return token, (out, made, done | stopped | (made >= max_new), past)

        def body(state: tuple) -> tuple:
            # Each step follows a draw that left a row unfinished: no step after the last token.
            position, token, caches, chosen_so_far = state
            logits, caches = jax.vmap(model.step)(token, caches)
            caches = shard_caches(caches)
            token, chosen_so_far = draw(position + 1, logits, chosen_so_far)
            return position + 1, token, caches, chosen_so_far

        out = jnp.full((batch, max_new), -1, jnp.int32)
        made, done = jnp.zeros(batch, jnp.int32), jnp.zeros(batch, bool)
        past = None if penalties is None else _history(penalties, prompts, lengths, logits)
        token, chosen_so_far = draw(jnp.int32(common), logits, (out, made, done, past))
        state = (jnp.int32(common), token, caches, chosen_so_far)
        state = jax.lax.while_loop(lambda s: ~jnp.all(s[-1][2]), body, state)
        _, _, _, (out, made, _, _) = state
        return Generation(out, made)

    return run


def _choose(
    chooser: Any, logits: jax.Array, past: History | None, position: Any, key: Any
) -> jax.Array:
    """`chooser`'s tokens from `logits (B, vocab)` after each row's penalties (`past`, if any)."""
    if past is not None:
        logits = penalised(logits, past, jnp.arange(logits.shape[0]))
    return chooser(logits, key, position)


def _history(penalties: Penalties, prompts: jax.Array, lengths: jax.Array, logits: Any) -> History:
    """The penalties' history of a batch of prompts `(B, longest)` (each `lengths[b]` long):
    every token of its prompt seen, no output yet."""
    batch, longest = prompts.shape
    vocab = logits.shape[-1]
    counts, _, bias, settings, _ = history_row(penalties, vocab, [])
    inside = (jnp.arange(longest)[None, :] < lengths[:, None]).astype(jnp.int32)
    seen = jnp.zeros((batch, vocab), jnp.int32).at[jnp.arange(batch)[:, None], prompts].max(inside)
    tile = lambda a: jnp.tile(jnp.asarray(a)[None], (batch,) + (1,) * a.ndim)  # noqa: E731
    return History(tile(counts), seen > 0, tile(bias), tile(settings), jnp.ones(batch, bool))
