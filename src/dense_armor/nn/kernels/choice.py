"""Which attention kernel a layer runs (its `implementation`): the scores materialised, in blocks
(`blocked`), or through `jax.nn.dot_product_attention` (XLA's or cuDNN's fused kernel); and the
export stage's context, in which cuDNN's kernel, a custom call jax.export refuses in a portable
artifact, lowers as XLA's."""

import contextlib
import contextvars
import typing
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .blocked import use_blocked

IMPLEMENTATIONS = ("auto", "materialised", "blocked", "xla", "cudnn")

_EXPORTING: contextvars.ContextVar[bool] = contextvars.ContextVar("exporting", default=False)


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    """Within it, an attention layer built with `implementation="cudnn"` lowers as `"xla"`:
    cuDNN's fused attention is a custom call that jax.export does not accept in a portable
    artifact. The export stage lowers every function in this context."""
    token = _EXPORTING.set(True)
    try:
        yield
    finally:
        _EXPORTING.reset(token)


def is_exporting() -> bool:
    """Whether this code runs in `exporting()`: a layer then traces what a portable artifact can
    hold (no custom call of one platform, no callback to Python)."""
    return _EXPORTING.get()


def resolve_implementation(memory_efficient: bool | None, implementation: str | None) -> str:
    """One attention implementation from a layer's two arguments (`memory_efficient`, the older
    spelling: `True` is `"blocked"`, `False` `"materialised"`, `None` `"auto"`)."""
    _check_memory_efficient(memory_efficient)
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"`implementation` must be one of {IMPLEMENTATIONS}; received "
            f"`implementation={implementation!r}`."
        )
    implied = {None: None, True: "blocked", False: "materialised"}[memory_efficient]
    if implementation is not None and implied is not None and implied != implementation:
        raise ValueError(
            f"`memory_efficient={memory_efficient}` means `implementation={implied!r}`; received "
            f"`implementation={implementation!r}` too. Pass one of them."
        )
    return implementation or implied or "auto"


def choose_kernel(implementation: str, queries: object, keys: object) -> str:
    """The kernel a layer built with `implementation` runs for `queries` against `keys` steps:
    `"xla"` or `"cudnn"` as asked, else `"blocked"` or `"materialised"` (`"auto"` by the number
    of scores; see `use_blocked`). Every attention layer and every path of one (forward, prefill,
    step) asks here."""
    if implementation in ("xla", "cudnn"):
        return implementation
    memory_efficient = older_spelling(implementation)
    return "blocked" if use_blocked(memory_efficient, queries, keys) else "materialised"


def older_spelling(implementation: str) -> bool | None:
    """`implementation` as `memory_efficient`: blocked (`True`), by length (`None`), or not
    (`False`)."""
    return {"auto": None, "blocked": True}.get(implementation, False)


def _dot_product_attention(
    q: Array, k: Array, v: Array, mask: Array | None, implementation: str
) -> Array:
    """`scaled_dot_product_attention` through `jax.nn.dot_product_attention` (XLA's or cuDNN's
    fused kernel), heads first `(n_heads, T, d_head)`, with this module's conventions kept: a
    query that sees no key gets zeros, and a hidden non-finite value stays hidden."""
    if implementation == "cudnn" and is_exporting():
        implementation = "xla"
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f"`implementation='cudnn'` runs cuDNN's fused attention, which needs an NVIDIA GPU; "
            f"this is jax's {jax.default_backend()!r} backend. Use 'xla' or 'auto'."
        )
    visible = None if mask is None else jnp.broadcast_to(mask, (q.shape[0], q.shape[1], k.shape[1]))
    finite = jnp.isfinite(v).all(axis=-1)  # (n_kv_heads, S)
    v = jnp.where(finite[..., None], v, jnp.zeros((), v.dtype))
    finite = jnp.repeat(finite, q.shape[0] // k.shape[0], axis=0)  # per query head
    out = jax.nn.dot_product_attention(
        q.transpose(1, 0, 2),
        k.transpose(1, 0, 2),
        v.transpose(1, 0, 2),
        mask=visible,
        implementation=typing.cast(Literal["xla", "cudnn"], implementation),
    ).transpose(1, 0, 2)
    if visible is None:
        sees_bad = jnp.broadcast_to(~finite.all(axis=-1)[:, None], out.shape[:2])
        return jnp.where(sees_bad[..., None], jnp.asarray(jnp.nan, out.dtype), out)
    sees_any = visible.any(axis=-1)
    sees_bad = (visible & ~finite[:, None, :]).any(axis=-1)
    out = jnp.where(sees_any[..., None], out, jnp.zeros((), out.dtype))
    return jnp.where(sees_bad[..., None], jnp.asarray(jnp.nan, out.dtype), out)


def _check_memory_efficient(memory_efficient: bool | None) -> None:
    if memory_efficient is not None and not isinstance(memory_efficient, bool):
        raise ValueError(
            "`memory_efficient` must be True, False or None (blocked attention from "
            f"`BLOCKED_MIN_LENGTH` steps on); received `memory_efficient={memory_efficient!r}`."
        )
