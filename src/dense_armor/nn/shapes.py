"""Runtime shape checks: `ShapeError`, and the decorators that check a layer method's or a
function's jaxtyping annotations (`shape_checked`, `type_checked`) with messages that name the
argument, the expected and the received shape; `check_steps`, a model's own check of what its
`step` or `prefill` receives. `dense_armor.nn.core` re-exports them beside `Layer`."""

import functools
import inspect
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

__all__ = ["ShapeError", "check_steps", "shape_checked", "type_checked"]


class ShapeError(ValueError):
    """An input whose rank, size or dtype does not match what the layer or function expects."""


Fn = TypeVar("Fn", bound=Callable[..., Any])


def _expected_dims(annotation: Any) -> tuple[str, ...] | None:
    dim_str = getattr(annotation, "dim_str", None)
    return None if dim_str is None else tuple(dim_str.split())


def _describe(dims: tuple[str, ...], sizes: dict[str, int]) -> str:
    parts = [f"{d}={sizes[d]}" if d in sizes else d for d in dims]
    return "(" + ", ".join(parts) + ")"


def _annotation_text(annotation: Any) -> str:
    """`Float['T d_model']`, `Bool['T'] | None`: a jaxtyping annotation as one reads it."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in _UNIONS else ()
    if options:
        return " | ".join(_annotation_text(option) for option in options)
    if annotation is type(None):
        return "None"
    dtype = getattr(annotation, "dtype", None)
    dim_str = getattr(annotation, "dim_str", None)
    if dtype is not None and dim_str is not None:
        return f"{dtype.__name__}[{dim_str!r}]"
    return getattr(annotation, "__name__", None) or str(annotation)


_UNIONS = (typing.Union, types.UnionType)


def _fails_alone(annotation: Any, value: Any) -> bool:
    """Whether `value` fails `annotation` by itself (jaxtyping's array types and classes;
    an annotation `isinstance` cannot take counts as failing)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return False
    try:
        return not isinstance(value, annotation)
    except TypeError:
        return True


def _mismatch(owner: str, signature: inspect.Signature, arguments: dict[str, Any]) -> ShapeError:
    """The `ShapeError` for arguments that fail their jaxtyping annotations: every array argument
    with its expected (annotated) and received shape and dtype."""
    lines = []
    named = {
        name: value
        for name, value in arguments.items()
        if name != "self" and name in signature.parameters
    }
    # The arguments that fail their annotation on their own (a dtype, a rank); when none does,
    # the sizes of a named axis disagree across them, and every argument is listed.
    alone = {n for n, v in named.items() if _fails_alone(signature.parameters[n].annotation, v)}
    for name, value in named.items():
        if alone and name not in alone:
            continue
        expected = _annotation_text(signature.parameters[name].annotation)
        shape = getattr(value, "shape", None)
        if shape is not None:
            received = f"shape {tuple(shape)} dtype {value.dtype}"
        elif value is None and "None" in expected.split(" | "):
            continue
        elif expected == type(value).__name__:  # the right kind, arrays of other shapes
            received = (
                f"a {expected} whose arrays have other shapes (a batch of streams from "
                "`init_streams`, with a leading axis on every array? step it with "
                "`jax.vmap(model.step)(x_t, caches)`)"
            )
        else:
            received = type(value).__name__
        lines.append(f"`{name}`: expected {expected}, received {received}")
    if alone:  # the dtype or rank of these arguments
        return ShapeError(f"{owner}: " + "; ".join(lines) + ".")
    return ShapeError(
        f"{owner}: the array arguments do not fit together ("
        + "; ".join(lines)
        + "). A named axis must have one size across the arguments."
    )


def check_steps(owner: str, name: str, x: Any, n_in: int | None, one_step: bool) -> None:
    """A model's own check of what its `step` (`one_step`: `x_t (n_in,)`) or `prefill` (`x (K,
    n_in)`) receives, so that a wrong input is named as the caller passed it, not as an inner
    layer saw it. `n_in=None`: any width. Runs at trace time."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    want = ("" if one_step else "K, ") + ("n_in" if n_in is None else f"n_in={n_in}")
    form = f"({want},)" if one_step else f"({want})"
    rank = 1 if one_step else 2
    floating = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
    width_ok = shape is not None and len(shape) == rank and n_in in (None, shape[-1])
    if floating and width_ok:
        return
    received = type(x).__name__ if shape is None else f"`{name}.shape={tuple(shape)}` dtype {dtype}"
    hint = (
        " A batch of streams goes through `jax.vmap(model.step)(x_t, caches)`."
        if one_step and shape is not None and len(shape) == 2
        else ""
    )
    raise ShapeError(
        f"{owner}: `{name}` must be {'one step' if one_step else 'K steps'} of shape {form}, "
        f"floating point; received {received}.{hint}"
    )


def _jax_arrays(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """NumPy array arguments as JAX arrays (NumPy inputs are welcome; JAX takes them as is)."""

    def convert(value: Any) -> Any:
        return jnp.asarray(value) if isinstance(value, np.ndarray) else value

    return tuple(map(convert, args)), {k: convert(v) for k, v in kwargs.items()}


def type_checked(function: Fn) -> Fn:
    """Check a function's jaxtyping annotations with beartype, NumPy arrays converted to JAX
    arrays first; a mismatch raises `ShapeError` naming every array argument's expected and
    received shape and dtype."""
    typechecked = jaxtyped(typechecker=beartype)(function)
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _checked_call(typechecked, signature, function.__qualname__, args, kwargs)

    return wrapper  # type: ignore[return-value]


def _checked_call(
    typechecked: Callable[..., Any],
    signature: inspect.Signature,
    owner: str,
    args: tuple,
    kwargs: dict,
) -> Any:
    """`typechecked(*args, **kwargs)`, NumPy arrays as JAX arrays, a mismatch raised as a
    `ShapeError` of `owner`'s."""
    args, kwargs = _jax_arrays(args, kwargs)
    try:
        return typechecked(*args, **kwargs)
    except TypeCheckError:
        bound = signature.bind_partial(*args, **kwargs)
        raise _mismatch(owner, signature, bound.arguments) from None


def shape_checked(method: Fn) -> Fn:
    """Check a layer method's array arguments before running it.

    NumPy arrays are converted to JAX arrays first. The method's jaxtyping annotations are checked
    by beartype (rank, dtype, and that a named axis
    has one size across the arguments and the result). Before that, every named axis that is also
    an integer attribute of the layer (`d_model`, `n_in`, ...) is compared with that attribute, and
    a wrong rank or size raises `ShapeError` naming the expected and the received shape, with a
    hint to use `jax.vmap` when the input carries one axis too many. Under `jax.jit` this runs
    once per trace and costs nothing per call.
    """
    typechecked = jaxtyped(typechecker=beartype)(method)
    signature = inspect.signature(method)

    called = method.__qualname__.rsplit(".", 1)[-1]

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        owner = f"{type(self).__name__}.{called}"  # the layer's class, not the base's defining it
        bound = signature.bind(self, *args, **kwargs)  # NumPy arrays: converted in the call
        for name, value in bound.arguments.items():
            dims = _expected_dims(signature.parameters[name].annotation)
            shape = getattr(value, "shape", None)
            if dims is None or shape is None:
                continue
            fixed = [d for d in dims if not d.startswith(("*", "..."))]
            variadic = len(fixed) != len(dims)
            sizes = {
                d: getattr(self, d)
                for d in fixed
                if isinstance(getattr(self, d, None), numbers.Integral)
            }
            rank_ok = len(shape) >= len(fixed) if variadic else len(shape) == len(fixed)
            trailing = dict(zip(reversed(fixed), reversed(shape), strict=False))
            size_ok = all(trailing.get(d) == size for d, size in sizes.items())
            if rank_ok and size_ok:
                continue
            message = (
                f"{owner}: received `{name}.shape={tuple(shape)}`; expected "
                f"`{_describe(dims, sizes)}`."
            )
            if not variadic and len(shape) == len(fixed) + 1:
                message += (
                    " A layer acts on one unbatched sequence; batch with "
                    "`jax.vmap(layer)(x)` or `eqx.filter_vmap`."
                )
            raise ShapeError(message)
        return _checked_call(typechecked, signature, owner, bound.args, bound.kwargs)

    return wrapper  # type: ignore[return-value]
