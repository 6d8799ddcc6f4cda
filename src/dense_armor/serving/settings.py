"""The `Server`'s settings, checked, and the keys its requests draw with."""

import os
import pathlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from ..nn.core import require_int
from ..nn.models.language_model import TransformerLM
from ..nn.state.paged import READS

__all__ = [
    "capacity_of", "compile_cache_dir", "enable_compile_cache", "key_data", "paging",
    "request_key",
]  # fmt: skip


def key_data(key: jax.Array) -> jax.Array:
    """A key's raw data (uint32), for a typed key or a legacy `PRNGKey`."""
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


@jax.jit
def request_key(key: jax.Array, number: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, number)


def capacity_of(
    model: TransformerLM,
    capacity: int | None,
    slots: int = 1,
    kv_dtype: str | None = None,
    paged: bool = False,
) -> int:
    """The cache slots per stream: `capacity`, at most the model's context; by default the
    context, unless `slots` whole caches of it would pass half of the memory left on the device
    (fixed slots only; a paged cache's memory is its pool): then the longest capacity that fits
    (a multiple of 16), with a warning that says so."""
    context = int(model.context)
    if capacity is not None:
        require_int(1, caller="Server", capacity=capacity)
        if capacity > context:
            raise ValueError(
                f"Server: `capacity={capacity}` passes the model's context of {context} "
                "positions (`max_len`: an imported checkpoint's max_position_embeddings, or "
                "LongRoPE's pretrained length)."
            )
        return int(capacity)
    if paged:
        return context
    per_position = _cache_bytes(model, 2, kv_dtype) - _cache_bytes(model, 1, kv_dtype)
    budget = memory_left() // 2
    if per_position <= 0 or slots * context * per_position <= budget:
        return context
    fits = budget // (slots * per_position) // 16 * 16
    if fits < 16:
        raise ValueError(
            f"Server: {slots} slots of the smallest cache (16 positions, {per_position * 16} "
            f"bytes each) pass half of the memory left ({budget * 2} bytes): give fewer `slots` "
            "or `pages`."
        )
    warnings.warn(
        f"Server: {slots} caches of the model's context ({context} positions, "
        f"{per_position * context} bytes each) would pass half of the memory left "
        f"({budget * 2} bytes); each slot holds {fits} positions. Give `capacity` (at most "
        "the context), fewer `slots`, or `pages` for a paged cache.",
        stacklevel=3,
    )
    return int(fits)


def _cache_bytes(model: TransformerLM, capacity: int, kv_dtype: str | None) -> int:
    """The bytes of one stream's cache of `capacity` positions (shapes only, nothing made)."""
    shapes = jax.eval_shape(lambda: model.init_cache(capacity, kv_dtype=kv_dtype))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))


def memory_left() -> int:
    """The bytes free on the default device: an accelerator's limit less what is in use, the
    host's available memory on the CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 2**40  # unknown: no bound


def paging(pages: Any, page_size: Any, share: Any) -> tuple[int, int, bool | None] | None:
    """The paged cache's settings, checked (None: fixed slots)."""
    if pages is None:
        if share:
            raise ValueError("Server: `share_prefixes` shares pages: give `pages` too.")
        return None
    require_int(2, caller="Server", pages=pages)
    require_int(1, caller="Server", page_size=page_size)
    if share is not None and not isinstance(share, bool):
        raise TypeError(
            f"Server: `share_prefixes` must be True, False or None; received {share!r}."
        )
    return int(pages), int(page_size), share


def paged_attention_of(given: Any) -> str:
    """`paged_attention`, checked: one of `nn.state.paged.READS`."""
    if given not in READS:
        raise ValueError(f"Server: `paged_attention` must be one of {READS}; received {given!r}.")
    return str(given)


# Decoding steps per dispatch at most (a request's tokens come back that many at a time).
MAX_DECODE_STEPS = 64


def decode_steps_of(given: Any) -> int:
    """`decode_steps`, checked (1, the default, to `MAX_DECODE_STEPS`)."""
    if given is None:
        return 1
    require_int(1, caller="Server", decode_steps=given)
    if given > MAX_DECODE_STEPS:
        raise ValueError(
            f"Server: `decode_steps` must be at most {MAX_DECODE_STEPS} (a request's tokens "
            f"come back that many at a time); received {given}."
        )
    return int(given)


def compile_cache_dir(given: str | None) -> pathlib.Path | None:
    """Where `serve` keeps JAX's compiled functions (`--compile-cache`), or None: `given`
    ('none' turns it off), else $JAX_COMPILATION_CACHE_DIR, else the user's cache directory."""
    if given is not None:
        return None if given.lower() == "none" else pathlib.Path(given).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "dense-armor" / "jax"


def enable_compile_cache(given: str | None) -> None:
    """JAX's persistent compilation cache on at `compile_cache_dir(given)`, every compiled
    function kept (small ones too: a server compiles many), before anything compiles; an
    `OSError` where the folder cannot be made."""
    directory = compile_cache_dir(given)
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def check_scores(logprobs: Any, prompt_logprobs: Any, most: int | None) -> None:
    """`Server.submit`'s `logprobs` and `prompt_logprobs`, on a server of `max_logprobs=most`."""
    if not isinstance(prompt_logprobs, bool):
        raise TypeError(
            f"Server.submit: `prompt_logprobs` must be True or False; received {prompt_logprobs!r}."
        )
    if logprobs is None:
        if prompt_logprobs:
            raise ValueError("Server.submit: `prompt_logprobs=True` needs `logprobs` too.")
        return
    require_int(0, caller="Server.submit", logprobs=logprobs)
    if most is None or logprobs > most:
        raise ValueError(
            f"Server.submit: `logprobs={logprobs}` passes the server's "
            f"max_logprobs={most} (make the Server with max_logprobs=k)."
        )


def check_room(
    prompt: int, max_new_tokens: int, capacity: int, paging: tuple[int, int, Any] | None
) -> None:
    """A request of `prompt` tokens and `max_new_tokens` fits a slot of `capacity` positions,
    and a paged server's pool (`paging`: its pages and page size), or a `ValueError`."""
    needed = prompt + int(max_new_tokens)
    if needed > capacity:
        raise ValueError(
            f"Server.submit: the prompt ({prompt} tokens) and `max_new_tokens="
            f"{max_new_tokens}` need {needed} cache slots; each slot holds "
            f"capacity={capacity}."
        )
    if paging is not None:
        pages, size, _ = paging
        rows = needed - 1  # the last new token is not written
        if -(-rows // size) > pages - 1:
            raise ValueError(
                f"Server.submit: the prompt and `max_new_tokens={max_new_tokens}` write "
                f"{rows} positions, {-(-rows // size)} pages of {size}; the pool has "
                f"{pages - 1} (`pages={pages}`, less the null page)."
            )
