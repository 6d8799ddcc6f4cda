"""The serving engine's compiled functions: a chunk's prefill (of one stream, or of a batch of
streams: `prefill_rows`), a slot's admission (of one stream, or of rows of a batch:
`admit_rows`), the tick (of fixed slots, or of paged ones: `paged_tick`), a paged stream's
start."""

import contextlib
import contextvars
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from ..nn.models.language_model import TransformerLM
from ..nn.penalties import History, counted, penalised
from ..nn.sampling import draw_rows, score_rows
from ..nn.sharding import laid_out
from ..nn.state.counter import Counter
from ..nn.state.paged import PagedKVCache, pool_mask, stream_axes, with_tables
from ..nn.state.streams import reset

__all__ = [
    "admit",
    "compile_now",
    "admit_rows",
    "first_tokens",
    "fresh_rows",
    "paged_prefill",
    "paged_prefill_scored",
    "paged_tick",
    "prefill",
    "prefill_scored",
    "prefill_rows",
    "put_row",
    "row_of",
    "start_stream",
    "tick",
    "tick_rows",
]


# `compile_now`'s default: compiles at once, at most (a 1B model's 8-slot warm-up on a TPU v5e
# host of 13 cores: 167 s one at a time, 67 s four at a time, 56 s eight)
THREADS = 8


def compile_now(
    calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]], threads: int | None = None
) -> None:
    """Compile each `(function, arguments)` of `calls` now, up to `threads` at once (default:
    `THREADS` or the machine's cores, the fewer; XLA compiles outside Python's lock, each compile
    holding its own memory), so that calling them later finds
    their executables in the jit caches. Each is traced as it would be here: in a copy of this
    thread's context variables (`ids_checked`) and under this thread's own JAX options (a
    context manager's `numpy_dtype_promotion`, ...: part of a compiled function's key). Where
    those options cannot be carried to a thread, nothing is compiled ahead: the calls compile
    as they come. Nothing runs."""
    count = max(1, min(len(calls), threads or min(THREADS, os.cpu_count() or 1)))
    contexts = [contextvars.copy_context() for _ in calls]
    options, key = _jax_options()

    def one(i: int) -> None:
        function, arguments = calls[i]
        with _jax_options_set(options):
            if _trace_key() == key:  # else the executable would be another call's
                contexts[i].run(lambda: function.lower(*arguments).compile())  # type: ignore[attr-defined]

    with warnings.catch_warnings():  # (the filters are the process's: every thread's too)
        # a donated argument no output can reuse, which Equinox's calls leave unsaid too
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        with ThreadPoolExecutor(count, thread_name_prefix="compile") as pool:
            list(pool.map(one, range(len(calls))))


def _trace_key() -> Any:
    """The options of this thread that key a compiled function (JAX's trace context)."""
    from jax._src import config

    return config.trace_context()


def _jax_options() -> tuple[list[tuple[Any, Any]], Any]:
    """This thread's own values of JAX's options (those its context managers set: the mesh of
    `jax.set_mesh` too), and its trace key; no values where JAX's configuration is not as known
    here."""
    try:
        from jax._src import config

        meshes = ("abstract_mesh_context_manager", "device_context", "mesh_context_manager")
        states = [*config.config_states.values()]
        states += [getattr(config, name) for name in meshes if hasattr(config, name)]
        return [(s, s.get_local()) for s in states], _trace_key()
    except (ImportError, AttributeError):  # pragma: no cover - another JAX's internals
        return [], None


@contextlib.contextmanager
def _jax_options_set(options: list[tuple[Any, Any]]) -> Iterator[None]:
    """This thread under `options` (`_jax_options`'s), restored after, as JAX's own context
    managers set and restore one (its hooks told)."""
    from jax._src import config

    def put(state: Any, value: Any) -> Any:
        previous = state.swap_local(value)
        hook = getattr(state, "_update_thread_local_hook", None)  # (the meshes' have none)
        if hook:
            hook(None if value is config.config_ext.unset else value)
        return previous

    previous = [(state, put(state, value)) for state, value in options]
    try:
        yield
    finally:
        for state, value in reversed(previous):
            put(state, value)


def _prefill(model: TransformerLM, ids: Any, cache: Any) -> tuple[jax.Array, Any]:
    h, cache = model._prefill_hidden(ids, cache)
    return h[-1], cache


@eqx.filter_jit(donate="all-except-first")  # the stream's cache in place
@laid_out
def prefill(inputs: tuple[TransformerLM, Any], cache: Any) -> tuple[jax.Array, Any]:
    """The last block's output after the last of `ids`, `(d_model,)` (after a prompt's last
    piece, `first_tokens` draws from it), and the cache after them (`inputs`: the model and
    `ids`)."""
    model, ids = inputs
    return _prefill(model, ids, cache)


def _scored(model: TransformerLM, h: Any, following: Any, top: int) -> Any:
    """The scores (`score_rows`) of `following (K,)`, the token after each of `K` positions
    whose last block's outputs are `h (K, d_model)`."""
    logits = model._logits(h)
    return score_rows(logits, following, jnp.ones(following.shape, bool), top)


@eqx.filter_jit(donate="all-except-first")  # the stream's cache in place
@laid_out
def prefill_scored(inputs: tuple[Any, ...], cache: Any) -> tuple[jax.Array, Any, Any]:
    """`prefill` that scores a prompt's tokens too (`inputs`: the model, `ids (K,)`, the token
    after each of them `following (K,)`, and `top`): the last output, the cache, and each next
    token's score at each position (the head at every position: a request that asks)."""
    model, ids, following, top = inputs
    h, cache = model._prefill_hidden(ids, cache)
    return h[-1], cache, _scored(model, h, following, top)


@eqx.filter_jit(donate="all-except-first")  # the streams' caches in place
@laid_out
def prefill_rows(inputs: tuple[TransformerLM, Any], caches: Any) -> tuple[jax.Array, Any]:
    """`prefill` of each row of `ids (R, n)` into its own stream of `caches` (a batch of `R`):
    the requests admitted together read the weights once per piece, not once each."""
    model, ids = inputs
    return jax.vmap(lambda x, c: _prefill(model, x, c))(ids, caches)


@eqx.filter_jit
@laid_out
def fresh_rows(model: TransformerLM, count: int, capacity: int, kv_dtype: Any) -> Any:
    """`count` empty streams (written in place by the prefill that takes them)."""
    return model.init_streams(count, capacity, on_overflow="nan", kv_dtype=kv_dtype)


@eqx.filter_jit(donate="all-except-first")  # the history in place
@laid_out
def first_tokens(
    model: TransformerLM, past: History, top: int, slots: Any, hidden: Any, *arrays: Any
) -> tuple[tuple[jax.Array, Any], History]:
    """The token each row of `hidden (R, d_model)` (a prompt's last output; row `r` slot
    `slots[r]`'s, or padding where `slots[r] < 0`) chooses: the head's logits, its slot's
    penalties (`past`), then `draw_rows` with each row's key, position and rules (`arrays`, the
    last of them which rows want their scores); its scores (`score_rows`, `top` alternatives,
    of the model's logits); the history with the tokens counted."""
    *rules, wanted = arrays
    logits = jax.vmap(lambda h: model._logits(h[None])[0])(hidden)
    rows = jnp.clip(slots, 0, past.active.shape[0] - 1)
    chosen = draw_rows(penalised(logits, past, rows), *rules)
    past = counted(past, rows, chosen, slots >= 0)
    return (chosen, score_rows(logits, chosen, wanted, top)), past


@eqx.filter_jit
@laid_out
def row_of(caches: Any, row: Any) -> Any:
    """Stream `row` of a batch of streams (a copy)."""
    return jax.tree.map(lambda a: a[row], caches)


@eqx.filter_jit(donate="all-except-first")
@laid_out
def put_row(new: tuple[Any, Any], caches: Any) -> Any:
    """A batch of streams with stream `row` replaced by `cache` (`new`), in place."""
    cache, row = new
    return jax.tree.map(lambda a, c: lax.dynamic_update_index_in_dim(a, c, row, 0), caches, cache)


@eqx.filter_jit(donate="all-except-first")  # the pools and the stream's state in place
@laid_out
def paged_prefill(
    model: TransformerLM, ids: Any, pools: Any, own: Any, table: Any
) -> tuple[Any, Any]:
    """`prefill` of one paged stream: `pools` (shared) and `own` (its counters and states), its
    pages those `table` lists; its own table comes back as it came."""
    cache = eqx.combine(pools, with_tables(own, table))
    cache = model.prefill(ids, cache)[1]
    return _parted(cache, own)


@eqx.filter_jit(donate="all-except-first")  # the pools and the stream's state in place
@laid_out
def paged_prefill_scored(
    model: TransformerLM, ids: Any, pools: Any, own: Any, table: Any, following: Any, top: int
) -> tuple[Any, Any, Any]:
    """`paged_prefill` that scores the token after each of `ids` too (`prefill_scored`)."""
    cache = eqx.combine(pools, with_tables(own, table))
    h, cache = model._prefill_hidden(ids, cache)
    return (*_parted(cache, own), _scored(model, h, following, top))


def _parted(cache: Any, own: Any) -> tuple[Any, Any]:
    """The pools and the streams' own states of `cache`, the latter with `own`'s tables."""
    pools, stepped = eqx.partition(cache, pool_mask(cache))
    paged = jax.tree.leaves(own, is_leaf=lambda n: isinstance(n, PagedKVCache))
    table = next(n.table for n in paged if isinstance(n, PagedKVCache))
    return pools, with_tables(stepped, table)


@eqx.filter_jit(donate="all-except-first")
@laid_out
def admit(new: tuple[jax.Array, Any], caches: Any) -> Any:
    """`caches` with the slots where `chosen` is true replaced by `cache` (`new`); the old
    caches' buffers donated, so the slots' memory is updated in place."""
    chosen, cache = new
    return reset(caches, chosen, cache)


@eqx.filter_jit(donate="all-except-first")
@laid_out
def admit_rows(new: tuple[Any, Any, Any], caches: Any) -> Any:
    """`caches` with slot `slots[j]` given row `j` of `rows` (a batch of streams) for each `j`
    below `count` (the rows past it pad the batch), in place: only the admitted slots are
    written."""
    slots, count, rows = new
    last = jax.tree.leaves(caches)[0].shape[0] - 1

    def one(j: Any, caches: Any) -> Any:
        slot = jnp.clip(slots[j], 0, last)  # in range by construction, whatever the host sent
        return jax.tree.map(
            lambda a, r: lax.dynamic_update_index_in_dim(a, r[j], slot, 0), caches, rows
        )

    return lax.fori_loop(0, count, one, caches)


def _ticks(
    step: Any, state: tuple[Any, History], shape: tuple[int, int], rows: Any, tokens: Any,
    positions: Any, *rules: Any,
) -> tuple[tuple[jax.Array, Any], tuple[Any, History]]:  # fmt: skip
    """`steps` rounds of `step (tokens, caches) -> (logits, caches)` over the slots `rows`
    (`state`: their caches, and every slot's penalties' history; `shape`: `(steps, top)`), the
    token each slot's logits choose after its penalties with its own rules and key
    (`draw_rows`: slot `b` at position `p` draws with `fold_in(keys[b], p)`) fed to the next
    round and counted in its history: the tokens `(steps, B)` and their scores (`score_rows`,
    of the model's logits, for the slots `wanted`, the last of `rules`). One dispatch for
    `steps` tokens of every slot; the host ends each request at its stop."""
    steps, top = shape
    keys, temperature, top_k, top_p, min_p, wanted = rules

    def one(carry: tuple[Any, Any, History], j: Any) -> tuple[tuple[Any, Any, History], Any]:
        caches, tokens, past = carry
        logits, caches = step(tokens, caches)
        adjusted = penalised(logits, past, rows)
        chosen = draw_rows(adjusted, keys, positions + j, temperature, top_k, top_p, min_p)
        past = counted(past, rows, chosen)
        return (caches, chosen, past), (chosen, score_rows(logits, chosen, wanted, top))

    caches, past = state
    (caches, _, past), (chosen, scores) = lax.scan(
        one, (caches, tokens, past), jnp.arange(steps, dtype=jnp.int32)
    )
    return (chosen, scores), (caches, past)


@eqx.filter_jit(donate="all-except-first")  # the caches are updated in place
@laid_out
def tick(
    model: TransformerLM, state: tuple[Any, History], shape: tuple[int, int], *arrays: Any
) -> tuple[tuple[jax.Array, Any], tuple[Any, History]]:
    """`steps` decoding steps of every slot (`shape`: `(steps, top)`; `state`: the caches and
    the penalties' history) from the tick's arrays (each slot's token, the position its logits
    choose, its key and rules, whether it wants its scores): the tokens `(steps, slots)` and
    their scores, and the state after them."""
    rows = jnp.arange(state[1].active.shape[0])
    return _ticks(jax.vmap(model.step), state, shape, rows, *arrays)


@eqx.filter_jit(donate="all-except-first")  # the caches are updated in place
@laid_out
def tick_rows(
    model: TransformerLM, state: tuple[Any, History], shape: tuple[int, int], rows: Any,
    *arrays: Any,
) -> tuple[tuple[jax.Array, Any], tuple[Any, History]]:  # fmt: skip
    """`tick` of the slots `rows (R,)` only (distinct; the busy ones, padded with idle ones to
    a power of two), with the tick's arrays of those slots: the tokens they choose `(steps,
    R)` and their scores; the other slots' caches come back as they came."""
    caches, past = state
    rows = jnp.clip(rows, 0, jax.tree.leaves(caches)[0].shape[0] - 1)
    chosen_caches = jax.tree.map(lambda a: a[rows], caches)
    step = jax.vmap(model.step)
    chosen, (stepped, past) = _ticks(step, (chosen_caches, past), shape, rows, *arrays)
    caches = jax.tree.map(
        lambda a, new: a.at[rows].set(new, mode="promise_in_bounds"), caches, stepped
    )
    return chosen, (caches, past)


@eqx.filter_jit(donate="all-except-first")  # the pools and the slots' states in place
@laid_out
def paged_tick(
    model: TransformerLM,
    state: tuple[Any, Any, History],
    shape: tuple[int, int],
    rows: Any,
    tables: Any,
    *arrays: Any,
) -> tuple[tuple[jax.Array, Any], tuple[Any, Any, History]]:
    """`tick` over the paged slots `rows (R,)` (distinct): `pools` (shared) and `own` (every
    slot's counters and states, `eqx.partition`ed by `pool_mask`), slot `rows[r]` reading the
    pages `tables[r]` lists, with the tick's arrays of those slots; the tokens they choose
    `(steps, R)` and their scores (`shape`: `(steps, top)`). The other slots' states, and
    every slot's own table (the host owns the tables), come back as they came (`state`: the
    pools, the slots' own states and the penalties' history)."""
    pools, own, past = state
    rows = jnp.clip(rows, 0, jax.tree.leaves(own)[0].shape[0] - 1)
    chosen_own = jax.tree.map(lambda a: a[rows], own)
    caches = eqx.combine(pools, with_tables(chosen_own, tables))
    axes = stream_axes(caches)
    step = jax.vmap(model.step, in_axes=(0, axes), out_axes=(0, axes))
    chosen, (caches, past) = _ticks(step, (caches, past), shape, rows, *arrays)
    pools, stepped = _parted(caches, chosen_own)
    own = jax.tree.map(lambda a, new: a.at[rows].set(new, mode="promise_in_bounds"), own, stepped)
    return chosen, (pools, own, past)


@eqx.filter_jit
@laid_out
def start_stream(fresh: Any, table: Any, index: Any) -> Any:
    """A paged stream's own state at its start: its `table`, every counter at `index` (past the
    shared prefix its pages hold already)."""

    def one(node: Any) -> Any:
        if isinstance(node, Counter):
            at = jnp.broadcast_to(jnp.asarray(index, node.index.dtype), node.index.shape)
            return eqx.tree_at(lambda c: c.index, node, at)  # a scanned stack's: every layer
        return node

    return jax.tree.map(one, with_tables(fresh, table), is_leaf=lambda n: isinstance(n, Counter))
