"""The pieces every layer shares: `Param`, the `Layer` base class and runtime shape checks.

A layer acts on one unbatched sequence of shape `(T, features)`; batches go through `jax.vmap`
(or `eqx.filter_vmap`), as in Equinox.
"""

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from . import products
from .shapes import ShapeError, check_steps, shape_checked, type_checked

__all__ = [
    "CannotStream",
    "NotAnInteger",
    "Layer",
    "Param",
    "Pointwise",
    "QuantizedParam",
    "check_steps",
    "is_integer",
    "ShapeError",
    "require_bool",
    "require_choice",
    "require_key",
    "require_int",
    "require_positive",
    "require_rate",
    "python_scalar",
    "shape_checked",
    "type_checked",
]


class CannotStream(ValueError):
    """A layer that cannot run step by step: not causal, or with no time state to carry."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Param:
    """A trainable array. Its one field `value` holds the array, so `m.P.value` reads a table.

    A frozen dataclass registered with JAX, not an `eqx.Module`: JAX flattens it in C++, where a
    Module's flatten runs Python code, and every jitted call flattens each of a model's `Param`s
    (about 0.3 against 2 us apiece; a decode step of one attention layer holds four). It acts as
    a Module would: an `eqx.tree_at` or `eqx.filter` target, `GetAttrKey("value")` in key paths,
    printed as `Param(value=f32[8,8])`, equal as `eqx.tree_equal` says."""

    value: Array

    def __repr__(self) -> str:
        return eqx.tree_pformat(self)

    def __eq__(self, other: object) -> Any:  # a Module's equality: `eqx.tree_equal`
        return eqx.tree_equal(self, other)

    def __hash__(self) -> int:
        return hash(("value", self.value))

    def project(self, x: Array, out_dtype: Any = None) -> Array:
        """`x @ value` over the last axis of `x`, in `out_dtype` (default: the dtype of `x`).

        The product's operands are in the narrower of the two dtypes (a bfloat16 computation
        reads float32 weights as bfloat16; float32 activations meet bfloat16 weights as
        bfloat16), accumulated in float32 (`products.project`)."""
        return products.project(x, self.value, out_dtype)

    def project_rows(self, x: Array, out_dtype: Any = None) -> Array:
        """`x @ value.T`: a table of rows `(n, d)` read as a projection (a tied head)."""
        return products.project(x, self.value, out_dtype, transposed=True)

    def rows(self, indices: Array) -> Array:
        """Rows `indices` of a table (clipped into range: callers mask what lies outside)."""
        table, indices = products.gathered_in_place(self.value, indices)
        return jnp.take(table, indices, axis=0, mode="clip")

    def array(self, dtype: Any) -> Array:
        """The weights as an array of `dtype` (what an einsum of its own reads)."""
        return self.value.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class QuantizedParam(Param):
    """Weights stored as int8 `value` with float32 `scale`s: the weights are `value * scale`,
    `scale` broadcast against `value` (one per output channel: `(..., 1, n_out)` for a matrix
    read as `x @ W`, `(vocab, 1)` for an embedding table). Built by `precision.quantize`; not
    trained (`value` is an integer array, which `eqx.is_inexact_array` leaves out).

    `project(x)` runs the product without a float copy of the matrix (`products.project_int8`);
    `array(dtype)` gives the scaled weights for the few einsums that read a whole array (the
    experts' stacks, a quantized tied head)."""

    scale: Array

    def project(self, x: Array, out_dtype: Any = None) -> Array:
        return products.project_int8(x, self.value, self.scale, out_dtype)

    def project_rows(self, x: Array, out_dtype: Any = None) -> Array:
        return products.project_int8(x, self.value, self.scale, out_dtype, transposed=True)

    def rows(self, indices: Array) -> Array:
        picked = jnp.take(self.value, indices, axis=0, mode="clip").astype(self.scale.dtype)
        return picked * jnp.take(self.scale, indices, axis=0, mode="clip")

    def array(self, dtype: Any) -> Array:
        return self.value.astype(dtype) * self.scale.astype(dtype)


def python_scalar(value: Any) -> Any:
    """A NumPy scalar (`np.int64(8)`) as the Python value it holds; anything else unchanged.

    The converter of every hyper-parameter field (`eqx.field(static=True,
    converter=python_scalar)`): a NumPy scalar is an array to JAX, and arrays are never static."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


class NotAnInteger(TypeError, ValueError):
    """A size, count or index that is not an integer at all (a float, a string, a bool): both a
    `TypeError` and a `ValueError`, as NumPy's `AxisError` is both a `ValueError` and an
    `IndexError`, so that either `except` clause catches it."""


def is_integer(value: Any) -> bool:
    """A Python or NumPy integer, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def require_int(
    minimum: int = 1, *, caller: str = "", error: type[Exception] = ValueError, **values: Any
) -> None:
    """The package's one integer check: raise naming the first of `values` that is not an
    integer (a Python or NumPy integer, never a bool, a float or a string) of at least
    `minimum`. The error is `error` (default `ValueError`; `NotAnInteger`, a `TypeError` too,
    for a value that is no integer at all), its message prefixed by `caller` when given. Store
    the value with `int(value)` (or a `python_scalar` field) once it has passed."""
    prefix = f"{caller}: " if caller else ""
    wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    for name, value in values.items():
        if not is_integer(value) or value < minimum:
            raise (NotAnInteger if error is ValueError and not is_integer(value) else error)(
                f"{prefix}`{name}` must be {wanted}; received `{name}={value!r}` "
                f"({type(value).__name__})."
            )


def require_positive(**sizes: Any) -> None:
    """`require_int(1, **sizes)`: each size a positive integer."""
    require_int(1, **sizes)


def require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """The package's one check of a named option: raise `ValueError` unless `value` is one of
    the strings `choices`, naming the option, the choices and what was received."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}; received `{name}={value!r}`.")


def require_bool(**flags: bool) -> None:
    """Raise `ValueError` naming the first flag that is not `True` or `False` (a string such as
    `"false"` would otherwise count as true)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(
                f"`{name}` must be True or False; received `{name}={flag!r}` "
                f"({type(flag).__name__})."
            )


def require_key(key: Any) -> None:
    """Raise `TypeError` unless `key` is a JAX PRNG key (`jax.random.PRNGKey(0)` or
    `jax.random.key(0)`)."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape[-1:] == (2,)
    if not (typed or raw):
        described = f"an array of dtype {key.dtype}" if hasattr(key, "dtype") else repr(key)
        raise TypeError(
            f"`key` must be a JAX PRNG key, e.g. `jax.random.PRNGKey(0)`; received {described}."
        )


def sees(query: Array, key: Array, window: int | None = None) -> Array:
    """Whether a step at position `query` sees a key at position `key` (broadcast together): the
    key is not later, and with a `window` it is one of the step's last `window` steps,
    `query - window < key <= query`. Every causal mask of the package (a sequence's, a cache's,
    a block of keys') is this rule on its own positions."""
    seen = key <= query
    return seen if window is None else seen & (key > query - window)


def require_rate(**rates: float) -> None:
    """Raise `ValueError` naming the first rate that is not a real number in `[0, 1]`."""
    for name, rate in rates.items():
        real = isinstance(rate, numbers.Real) and not isinstance(rate, bool | np.bool_)
        if not real or not 0.0 <= rate <= 1.0:
            raise ValueError(
                f"`{name}` must be a number in [0, 1]; received `{name}={rate!r}` "
                f"({type(rate).__name__})."
            )


_CALLER: contextvars.ContextVar[tuple[Any, str] | None] = contextvars.ContextVar(
    "dense_armor_caller", default=None
)


@contextlib.contextmanager
def _calling(layer: Any, name: str) -> Iterator[None]:
    token = _CALLER.set((layer, name))
    try:
        yield
    finally:
        _CALLER.reset(token)


def called_as(layer: Any, default: str) -> str:
    """The method of `layer` its errors should name: `X.step` while `layer.step` runs its
    `prefill`, else `default`. Only `layer` itself sees it: the layers inside it keep their own
    names."""
    caller = _CALLER.get()
    return caller[1] if caller is not None and caller[0] is layer else default


@functools.cache
def _step_check(cls: type, method: str = "prefill") -> Callable[..., None]:
    """`cls.step`'s input check, derived from the annotations of `cls.prefill` (its `x` less the
    leading step axis: `Float[Array, "K d_model"]` becomes `Float[Array, " d_model"]` for `x_t`;
    its cache's annotation as it is) or of `cls.forward` (a pointwise layer's: its `x` takes any
    leading axes, so it fits `x_t` as it is), run by `shape_checked` under the name `cls.step`."""
    parameters = list(inspect.signature(inspect.unwrap(getattr(cls, method))).parameters.values())
    parameters = [p for p in parameters[1:3] if p.kind is p.POSITIONAL_OR_KEYWORD]
    chunk: Any = parameters[0].annotation if parameters else None
    dims = getattr(chunk, "dim_str", None)

    def check(self: Any, x_t: Any, cache: Any = None) -> None:
        return None

    if not isinstance(dims, str) or not dims.split():
        return check
    if method == "prefill":
        chunk = chunk.dtype[chunk.array_type, " " + " ".join(dims.split()[1:])]
    check.__annotations__ = {"x_t": chunk}
    if method == "prefill" and len(parameters) > 1:
        check.__annotations__["cache"] = parameters[1].annotation
    check.__qualname__ = f"{cls.__name__}.step"
    return shape_checked(check)


class Layer(eqx.Module):
    """Base class of every dense_armor layer.

    `forward` is the computation; `__call__` is the same method, so a layer drops into any Equinox
    code. `params()` lists the layer's `Param`s in the order of its fields, depth first.
    Layers that can run in a causal model also stream: `init_cache(capacity)`,
    `step(x_t, cache) -> (y_t, cache)` and `prefill(x_chunk, cache) -> (y_chunk, cache)` (what
    `K` calls of `step` return, stacked); the others raise `CannotStream`.

    Masks mean the same in every layer: `forward(x, mask=None)` takes a boolean vector `mask (T,)`
    over the steps of `x`, `True` on the valid steps of a sequence padded at the end. A padded
    step is hidden from every other step (its key is never attended to, it is left out of a
    mean), and its own output row is whatever the layer computes for it, to be ignored. A
    cross-attention's `context_mask (S,)` is the same over its context. A layer with
    `accepts_mask = True` takes one; `Sequential` passes it to those layers. (Only the functions
    `scaled_dot_product_attention` and `attention_weights` take a mask over the scores,
    `(..., T, S)`, as the attention page defines it.)
    """

    # Tensor parallelism (`dense_armor.distributed`): the arrays of this layer that a `"model"`
    # mesh axis splits, `{"attribute path": (axis, count)}`, the axis counted from the end (so a
    # stacked layer's leading depth axis changes nothing) and `count` the field that holds how
    # many heads that axis groups (`None`: its units, split one by one).
    tensor_parallel: ClassVar[Mapping[str, tuple[int, str | None]]] = {}
    # Capabilities, read by the models around a layer, each declared here with its default and
    # overridden by the layers that have it (with a class variable, or with a field or a property
    # where it depends on the instance): `causal`, step t sees only steps up to t, so the layer
    # streams; `accepts_mask`, its `forward` takes the padding `mask`; `stackable`, copies of it
    # stack on a depth axis (`Stack`); `layers_field`, the field holding the layers a model
    # applies in order (what `stack_layers` regroups), or `None`.
    causal: ClassVar[bool] = False
    accepts_mask: ClassVar[bool] = False
    stackable: ClassVar[bool] = False
    layers_field: ClassVar[str | None] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def params(self) -> list[Param]:
        """The layer's `Param`s, in field order (depth first)."""
        leaves = jax.tree_util.tree_leaves(self, is_leaf=lambda node: isinstance(node, Param))
        return [leaf for leaf in leaves if isinstance(leaf, Param)]

    def init_cache(self, *args: Any, **kwargs: Any) -> Any:
        raise CannotStream(f"{type(self).__name__} does not stream: it has no `init_cache`.")

    def prefill(self, x: Any, cache: Any) -> tuple[Any, Any]:
        raise CannotStream(f"{type(self).__name__} does not stream: it has no `prefill`.")

    def step(self, x_t: Any, cache: Any) -> tuple[Any, Any]:
        """One step, `x_t` one row of what `prefill` takes: `prefill` of the one-step chunk
        `x_t[None]`, its row `0`, and the cache after it. After `t+1` steps, row `t` of `forward`
        on those steps.

        Defined here once for every layer (a layer streams by defining `prefill`). `x_t` is
        checked first against `prefill`'s annotation less its leading step axis (or by the
        layer's `check_step`), so a wrong input is named as the caller passed it, and the errors
        of `prefill` name `step` as the method called."""
        self.check_step(x_t, cache)
        with _calling(self, f"{type(self).__name__}.step"):
            y, cache = self.prefill(x_t[None], cache)
        return y[0], cache

    def check_step(self, x_t: Any, cache: Any) -> None:
        """Check what `step` receives, before it runs `prefill`: by default against `prefill`'s
        jaxtyping annotations, the leading step axis of `x` removed (nothing where `prefill` has
        none). Runs at trace time."""
        _step_check(type(self))(self, x_t, cache)


class Pointwise(Layer):
    """A layer that acts on each time step alone, so stepping it is its forward on one sample.

    Its cache is `None`.
    """

    def init_cache(self, capacity: int | None = None, *, on_overflow: str = "raise") -> None:
        return None

    def prefill(self, x: Any, cache: None) -> tuple[Any, None]:
        return self.forward(x), cache

    def check_step(self, x_t: Any, cache: None) -> None:
        """`forward`'s check, on `x_t` as it is (a pointwise layer takes any leading axes)."""
        _step_check(type(self), "forward")(self, x_t)
