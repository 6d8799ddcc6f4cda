"""The pieces of training with optax on Equinox models: a jitted train step (with gradient
accumulation, and micro-batches chosen by its size on a CPU) and evaluation (data-parallel on a
mesh) over the losses of `training.losses`. `fit` (`training.loop`) drives them."""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from ..distributed import global_batch, global_replicated
from ..nn.core import require_int
from ..nn.sharding import check_mesh
from .data import process_rows
from .losses import Loss, LossFn, as_loss, cross_entropy_loss

__all__ = ["CPU_STEP_BYTES", "evaluate", "evaluate_checked", "make_train_step"]

#: The most temporary memory a training step on one CPU device takes before `make_train_step`
#: splits its batch into micro-batches (see there): glibc's largest recycled block, 32 MiB, less
#: a slack for the block's header and alignment. Below it the step gains nothing from a split
#: (a language model's step of 30 MiB: no page fault whole, 9-17% slower in two micro-batches).
CPU_STEP_BYTES = 31 * 2**20


def make_train_step(
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn = cross_entropy_loss,
    accumulate: int | None = None,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
    """A jitted `step(model, opt_state, xs, labels, key) -> (model, opt_state, loss)` (`key`
    may be `None` for a model without dropout).

    `accumulate=k`: the batch is split into `k` equal micro-batches whose gradients are summed
    one after the other (a `jax.lax.scan`, so only one micro-batch's activations are alive at a
    time) and averaged: one optimizer update equal to that of the whole batch, to float32
    round-off, for a loss that is a mean over the batch. With dropout, each micro-batch draws its
    own masks.

    `accumulate=None` (the default) chooses `k` once per batch shape (the shape, dtype and
    placement of `xs` and `labels`, and whether a `key` is given), at the first call with it: 1,
    unless the batch is on one CPU device and the loss is a mean over its samples
    (`Loss.averages_samples`: the library's losses). Then, if the step's temporary buffers
    (XLA's figure for the compiled step) exceed `CPU_STEP_BYTES` (31 MiB), the fewest micro-batches
    (a divisor of the batch) that bring them under it. XLA's CPU runtime allocates a step's
    temporaries afresh at every call; past 32 MiB the C allocator maps them from the operating
    system each time, and a page fault per 4 KiB touched then costs a quarter of the step's CPU
    time. Micro-batches that stay under it reuse the same memory, warm in the caches: 1.2-1.4x
    faster for the encoder of the README's table. Such a step compiles twice at its first call
    (the whole batch, to read its size, then the micro-batches); a step that fits compiles once
    (the measured compilation is the one its calls then use). `step.micro_batches(model,
    opt_state, xs, labels, key)` says which `k` a batch gets. On a GPU or TPU, over several
    devices, or inside another trace, `k` is 1.
    """
    if accumulate is not None:
        require_int(1, caller="make_train_step", accumulate=accumulate)
    loss = as_loss(loss_fn)
    steps: dict[int, Any] = {}

    def jitted(k: int) -> Any:
        if k not in steps:
            steps[k] = eqx.filter_jit(functools.partial(_train_step, optimizer, loss, k))
        return steps[k]

    if accumulate is not None:
        return jitted(accumulate)
    return _AutoStep(jitted, loss.averages_samples)


def _train_step(
    optimizer: optax.GradientTransformation,
    loss: "Loss",
    accumulate: int,
    model: Any,
    opt_state: Any,
    xs: jax.Array,
    labels: jax.Array,
    key: jax.Array | None,
) -> tuple[Any, Any, jax.Array]:
    """One optimizer update of `model` on the batch `(xs, labels)`, in `accumulate`
    micro-batches (see `make_train_step`)."""
    if (loss.averages_samples or accumulate > 1) and np.shape(labels)[:1] != np.shape(xs)[:1]:
        raise ValueError(
            f"make_train_step: a batch of {np.shape(xs)[:1]} inputs needs one label per input; "
            f"received labels of shape {np.shape(labels)}."
        )
    value, grads = _value_and_grad(loss, accumulate, model, xs, labels, key)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, value


def _value_and_grad(
    loss: "Loss", accumulate: int, model: Any, xs: jax.Array, labels: jax.Array, key: Any
) -> tuple[jax.Array, Any]:
    """The mean loss on `(xs, labels)` and its gradient, in `accumulate` micro-batches."""
    if accumulate == 1:
        return eqx.filter_value_and_grad(loss)(model, xs, labels, key)
    if xs.shape[0] % accumulate:
        raise ValueError(
            f"accumulate={accumulate} needs a batch it divides; received {xs.shape[0]}."
        )

    def micro(xs: jax.Array) -> jax.Array:
        return xs.reshape(accumulate, xs.shape[0] // accumulate, *xs.shape[1:])

    def one(total: Any, batch: Any) -> tuple[Any, None]:
        x, y, k = batch
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y, k)
        return jax.tree.map(jnp.add, total, (value, grads)), None

    start = (
        jnp.zeros(()),
        jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array)),
    )
    keys = None if key is None else jax.random.split(key, accumulate)
    (value, grads), _ = jax.lax.scan(one, start, (micro(xs), micro(labels), keys))
    return value / accumulate, jax.tree.map(lambda g: g / accumulate, grads)


class _AutoStep:
    """The step of `make_train_step(accumulate=None)`: per batch shape, the whole batch or the
    micro-batches its size on a CPU asks for, chosen once; every call then goes through that
    choice's `eqx.filter_jit` step (whose compilation the choice's own compile left in JAX's
    cache)."""

    def __init__(self, jitted: Callable[[int], Any], averages_samples: bool):
        self._jitted = jitted
        self._averages_samples = averages_samples
        self._chosen: dict[Any, int] = {}

    def __call__(
        self, model: Any, opt_state: Any, xs: Any, labels: Any, key: Any = None
    ) -> tuple[Any, Any, jax.Array]:
        args = (model, opt_state, xs, labels, key)
        return self._jitted(self._choice(args))(*args)

    def micro_batches(
        self, model: Any, opt_state: Any, xs: Any, labels: Any, key: Any = None
    ) -> int:
        """How many micro-batches this step runs the batch `(xs, labels)` in."""
        return self._choice((model, opt_state, xs, labels, key))

    def _choice(self, args: tuple) -> int:
        """The micro-batches for this batch: 1 where the whole batch is the only choice (no CPU,
        several devices, a trace, a loss not known to be a mean, one sample), else chosen at
        the first call with its shape."""
        xs, labels, key = args[2:]
        if (
            not self._averages_samples
            or isinstance(xs, jax.core.Tracer)
            or np.ndim(xs) == 0
            or np.shape(xs)[0] < 2
            or not _one_cpu(xs)
        ):
            return 1
        shape = (_batch_signature(xs), _batch_signature(labels), key is None)
        if shape not in self._chosen:
            self._chosen[shape] = self._measure(args)
        return self._chosen[shape]

    def _measure(self, args: tuple) -> int:
        """Compile the whole-batch step, read XLA's figure for its temporaries, and return the
        fewest micro-batches (a divisor of the batch) that bring them under `CPU_STEP_BYTES`."""
        temp = _temp_bytes(self._jitted(1).lower(*args).compile())
        if temp <= CPU_STEP_BYTES:
            return 1
        batch = np.shape(args[2])[0]
        return next(
            (k for k in range(2, batch + 1) if batch % k == 0 and temp / k <= CPU_STEP_BYTES),
            batch,
        )


def _temp_bytes(compiled: Any) -> int:
    """The temporary buffers of an `eqx.filter_jit(...).lower(...).compile()`, in bytes (0 where
    the backend does not say)."""
    analysis = compiled.compiled.memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)


def _batch_signature(a: Any) -> Any:
    """The shape, dtype and placement of a batch's array (of a NumPy or nested-list batch: its
    shape and dtype)."""
    if isinstance(a, jax.Array):
        return a.shape, a.dtype, a.sharding
    array = np.asarray(a)
    return array.shape, array.dtype


def _one_cpu(xs: Any) -> bool:
    """Whether the batch `xs` is on one CPU device (a NumPy batch: whether JAX's default device
    is a CPU)."""
    devices = xs.devices() if isinstance(xs, jax.Array) else {jax.devices()[0]}
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


@eqx.filter_jit
def _batch_metrics(
    model: Any, xs: jax.Array, labels: jax.Array, loss: Loss
) -> tuple[jax.Array, jax.Array | None]:
    """The batch's summed loss (`loss`'s mean times the batch size) and its correct predictions
    (`None` for a loss that reports no accuracy)."""
    return loss(model, xs, labels, None) * xs.shape[0], loss.correct(model, xs, labels)


def evaluate(
    model: Any,
    xs: Any,
    labels: Any,
    batch_size: int = 512,
    mesh: Mesh | None = None,
    loss_fn: LossFn = cross_entropy_loss,
) -> dict[str, float]:
    """Mean loss (of `loss_fn`, the one `fit` trains with; default the cross-entropy) and, with
    the default loss, the accuracy of `model` over `(xs, labels)`, in batches (inference: no
    dropout).

    With the default loss, `labels` are class indices in `[0, n_out)`. With a `mesh` (a model
    placed on it), every process passes the same data, and each batch is split across the
    devices of the mesh's `"data"` axis (data-parallel evaluation; the rows of a batch that the
    axis does not divide are evaluated replicated)."""
    require_int(1, caller="evaluate", batch_size=batch_size)
    if mesh is not None:
        check_mesh("evaluate", mesh)
    loss = as_loss(loss_fn)
    loss.check_data("evaluate", model, xs, labels)
    return evaluate_checked(model, xs, labels, batch_size, mesh, loss)


def evaluate_checked(
    model: Any,
    xs: Any,
    labels: Any,
    batch_size: int,
    mesh: Mesh | None,
    loss_fn: LossFn,
) -> dict[str, float]:
    """`evaluate` on data already checked (traced in the loss's `checked_inputs()`)."""
    loss = as_loss(loss_fn)
    total_loss, correct = 0.0, 0.0
    reports_accuracy = True
    for start in range(0, len(xs), batch_size):
        rows = slice(start, min(start + batch_size, len(xs)))
        for batch_xs, batch_labels in _placed_batches(mesh, xs[rows], labels[rows]):
            with loss.checked_inputs():
                summed, hits = _batch_metrics(model, batch_xs, batch_labels, loss)
            total_loss += float(summed)
            reports_accuracy = hits is not None
            correct += 0 if hits is None else float(hits)
    metrics = {"loss": total_loss / len(xs)}
    if reports_accuracy:
        metrics["accuracy"] = correct / len(xs)
    return metrics


def _placed_batches(mesh: Mesh | None, xs: Any, labels: Any) -> list[tuple[jax.Array, jax.Array]]:
    """A batch as the arrays to evaluate: as it is without a mesh; with one, its largest part that
    the mesh's `"data"` axis divides split across the devices (each process passing its share, in
    process order), and the few rows left replicated."""
    xs, labels = np.asarray(xs), np.asarray(labels)
    if mesh is None:
        return [(jnp.asarray(xs), jnp.asarray(labels))]
    even = len(xs) - len(xs) % mesh.shape["data"]
    placed = []
    if even:
        mine = process_rows(mesh, even)
        split = (global_batch(mesh, xs[mine]), global_batch(mesh, labels[mine]))
        placed.append(split)
    if even < len(xs):
        rest = (global_replicated(mesh, xs[even:]), global_replicated(mesh, labels[even:]))
        placed.append(rest)
    return placed
