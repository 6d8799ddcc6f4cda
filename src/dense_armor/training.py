"""Training with optax on Equinox models: a jitted train step, evaluation, and a resumable fit loop.

The fit loop is reproducible from its seed: batch `s` and its dropout key are functions of
`(seed, s)` alone, so a run resumed from a checkpoint continues exactly as an uninterrupted one.
"""

import dataclasses
import math
import numbers
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from .checkpoint import (
    CheckpointError,
    ModelConfig,
    fill_tree,
    load_checkpoint,
    save_checkpoint,
    tree_arrays,
)
from .distributed import global_batch, global_replicated, place

__all__ = ["FitResult", "cross_entropy_loss", "evaluate", "fit", "make_train_step"]

LossFn = Callable[[Any, jax.Array, jax.Array, jax.Array | None], jax.Array]


def cross_entropy_loss(
    model: Any, xs: jax.Array, labels: jax.Array, key: jax.Array | None = None
) -> jax.Array:
    """Mean softmax cross-entropy of `model` on a batch `xs (B, T, n_in)` with integer `labels`.

    With a `key`, each sample gets its own dropout key.
    """
    if key is None:
        logits = jax.vmap(model)(xs)
    else:
        keys = jax.random.split(key, xs.shape[0])
        logits = jax.vmap(lambda x, k: model(x, key=k))(xs, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_train_step(
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn = cross_entropy_loss,
    accumulate: int = 1,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
    """A jitted `step(model, opt_state, xs, labels, key) -> (model, opt_state, loss)`.

    `accumulate=k`: the batch is split into `k` equal micro-batches whose gradients are summed
    one after the other (a `jax.lax.scan`, so only one micro-batch's activations are alive at a
    time) and averaged: one optimizer update equal to that of the whole batch, to float32
    round-off, for a loss that is a mean over the batch. With dropout, each micro-batch draws its
    own masks."""
    _require_int("make_train_step", 1, accumulate=accumulate)

    def value_and_grad(model: Any, xs: jax.Array, labels: jax.Array, key: jax.Array) -> Any:
        if accumulate == 1:
            return eqx.filter_value_and_grad(loss_fn)(model, xs, labels, key)
        if xs.shape[0] % accumulate:
            raise ValueError(
                f"accumulate={accumulate} needs a batch it divides; received {xs.shape[0]}."
            )

        def micro(xs: jax.Array) -> jax.Array:
            return xs.reshape(accumulate, xs.shape[0] // accumulate, *xs.shape[1:])

        def one(total: Any, batch: Any) -> tuple[Any, None]:
            x, y, k = batch
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y, k)
            return jax.tree.map(jnp.add, total, (loss, grads)), None

        start = (
            jnp.zeros(()),
            jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array)),
        )
        batches = (micro(xs), micro(labels), jax.random.split(key, accumulate))
        (loss, grads), _ = jax.lax.scan(one, start, batches)
        return loss / accumulate, jax.tree.map(lambda g: g / accumulate, grads)

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, xs: jax.Array, labels: jax.Array, key: jax.Array) -> Any:
        loss, grads = value_and_grad(model, xs, labels, key)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


@eqx.filter_jit
def _batch_metrics(
    model: Any, xs: jax.Array, labels: jax.Array, loss_fn: LossFn
) -> tuple[jax.Array, jax.Array]:
    """The batch's summed loss (`loss_fn`'s mean times the batch size) and its correct argmax
    predictions (meaningful for the default classification loss)."""
    loss = loss_fn(model, xs, labels, None) * xs.shape[0]
    if loss_fn is not cross_entropy_loss:
        return loss, jnp.zeros((), jnp.int32)
    return loss, (jax.vmap(model)(xs).argmax(axis=-1) == labels).sum()


def _require_int(caller: str, minimum: int, **values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"{caller}: `{name}` must be an integer; received `{name}={value!r}` "
                f"({type(value).__name__})."
            )
        if value < minimum:
            raise ValueError(f"{caller}: `{name}` must be at least {minimum}; received {value}.")


def check_classification_data(caller: str, model: Any, xs: Any, labels: Any) -> None:
    """Raise `ValueError` unless `labels` are `len(xs)` integers in `[0, n_out)`, where `n_out`
    is the width of `model`'s output (a label outside would train silently: optax takes -1 as the
    last class)."""
    if len(xs) == 0:
        raise ValueError(f"{caller}: received an empty data set.")
    if len(xs) != len(labels):
        raise ValueError(f"{caller}: {len(xs)} inputs but {len(labels)} labels.")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(
            f"{caller}: `labels` must have shape (N,), one class index per input; received shape "
            f"{labels.shape}."
            + (" Flatten them: `labels.reshape(-1)`." if labels.size == len(xs) else "")
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{caller}: `labels` must be integers; received dtype {labels.dtype}.")
    n_out = eqx.filter_eval_shape(model, jnp.asarray(xs[0])).shape[-1]
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= n_out:
        raise ValueError(
            f"{caller}: `labels` must lie in [0, {n_out}) for a model of {n_out} outputs; "
            f"received labels from {low} to {high}."
        )


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
    _require_int("evaluate", 1, batch_size=batch_size)
    if loss_fn is cross_entropy_loss:
        check_classification_data("evaluate", model, xs, labels)
    elif len(xs) == 0 or len(xs) != len(labels):
        raise ValueError(f"evaluate: {len(xs)} inputs and {len(labels)} labels.")
    return _evaluate(model, xs, labels, batch_size, mesh, loss_fn)


def _evaluate(
    model: Any,
    xs: Any,
    labels: Any,
    batch_size: int,
    mesh: Mesh | None,
    loss_fn: LossFn,
) -> dict[str, float]:
    """`evaluate` on data already checked."""
    total_loss, correct = 0.0, 0
    for start in range(0, len(xs), batch_size):
        rows = slice(start, min(start + batch_size, len(xs)))
        for batch_xs, batch_labels in _placed_batches(mesh, xs[rows], labels[rows]):
            loss, hits = _batch_metrics(model, batch_xs, batch_labels, loss_fn)
            total_loss += float(loss)
            correct += int(hits)
    metrics = {"loss": total_loss / len(xs)}
    if loss_fn is cross_entropy_loss:
        metrics["accuracy"] = correct / len(xs)
    return metrics


def _this_process(rows: np.ndarray) -> np.ndarray:
    """This process's share of a global batch's `rows`: the `i`-th of `process_count` equal parts,
    as `global_batch` takes it."""
    share = len(rows) // jax.process_count()
    return rows[jax.process_index() * share : (jax.process_index() + 1) * share]


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
        mine = _this_process(np.arange(even))
        split = (global_batch(mesh, xs[mine]), global_batch(mesh, labels[mine]))
        placed.append(split)
    if even < len(xs):
        rest = (global_replicated(mesh, xs[even:]), global_replicated(mesh, labels[even:]))
        placed.append(rest)
    return placed


@dataclasses.dataclass
class FitResult:
    """The trained model, the optimizer state, and the history of evaluations."""

    model: Any
    opt_state: Any
    history: list[dict[str, float]]
    best: dict[str, float] | None


def _batch_indices(seed: int, step: int, n: int, batch_size: int) -> np.ndarray:
    per_epoch = n // batch_size
    epoch, within = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[within * batch_size : (within + 1) * batch_size]


def fit(
    model: Any,
    optimizer: optax.GradientTransformation,
    train: tuple[Any, Any],
    *,
    steps: int,
    batch_size: int = 64,
    seed: int = 0,
    valid: tuple[Any, Any] | None = None,
    eval_every: int = 100,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    config: ModelConfig | None = None,
    resume: bool = True,
    progress: bool = True,
    loss_fn: LossFn = cross_entropy_loss,
    mesh: Mesh | None = None,
    shard_params: bool = False,
    accumulate: int = 1,
) -> FitResult:
    """Train `model` for `steps` optimizer steps on `train = (xs, labels)`.

    Every `eval_every` steps (and at the end) it records the mean training loss since the last
    record and, with `valid`, the validation loss and accuracy. With `checkpoint_dir` (and the
    model's `config`), it saves `checkpoint_dir/last` (model, optimizer state, step, history) at
    each record and `checkpoint_dir/best` whenever the validation accuracy improves (the training
    loss without `valid`), and with `resume=True` it continues from `last` if present.

    A progress bar shows the loss and the throughput (samples per second).

    With a `mesh` (`dense_armor.distributed.data_mesh()`), each batch is sharded over its `"data"`
    axis and the model and optimizer state are replicated on it, or split over it with
    `shard_params=True`; the losses are those of the single-device run, to float32 round-off.
    With several processes, every process calls `fit` with the same arguments and data, and feeds
    its own slice of each global batch; process 0 writes the checkpoints.

    `accumulate=k` splits each batch into `k` micro-batches and accumulates their gradients
    before one optimizer update (`make_train_step`): the same training as the whole batch, with
    the activations of one micro-batch in memory at a time.
    """
    xs, labels = np.asarray(train[0]), np.asarray(train[1])
    _require_int("fit", 0, steps=steps, seed=seed)
    _require_int("fit", 1, batch_size=batch_size, eval_every=eval_every)
    if len(xs) != len(labels):
        raise ValueError(f"fit: {len(xs)} inputs but {len(labels)} labels.")
    if loss_fn is cross_entropy_loss:  # a custom loss may take other targets
        check_classification_data("fit", model, xs, labels)
        if valid is not None:
            check_classification_data("fit (valid)", model, *valid)
    if not 1 <= batch_size <= len(xs):
        raise ValueError(f"fit: `batch_size={batch_size}` must lie in [1, {len(xs)}].")
    if checkpoint_dir is not None and config is None:
        raise ValueError("fit: saving checkpoints needs the model's `config`.")
    _require_int("fit", 1, accumulate=accumulate)
    if batch_size % accumulate:
        raise ValueError(
            f"fit: `accumulate={accumulate}` micro-batches must divide `batch_size={batch_size}`."
        )
    micro = batch_size // accumulate
    if mesh is not None and micro % mesh.size:
        raise ValueError(
            f"fit: each of the {accumulate} micro-batches (`batch_size={batch_size}` in all) must "
            f"be a multiple of the mesh's {mesh.size} devices."
        )

    def placed(tree: Any) -> Any:
        return tree if mesh is None else place(tree, mesh, shard_params)

    model = placed(model)
    opt_state = placed(optimizer.init(eqx.filter(model, eqx.is_inexact_array)))
    history: list[dict[str, float]] = []
    best: dict[str, float] | None = None
    start_step = 0
    last_dir = best_dir = None
    if checkpoint_dir is not None:
        last_dir = pathlib.Path(checkpoint_dir) / "last"
        best_dir = pathlib.Path(checkpoint_dir) / "best"
        if resume and (last_dir.exists() or last_dir.with_name("last.previous").exists()):
            saved = load_checkpoint(last_dir)
            if config is not None and saved.config != config:
                raise CheckpointError(
                    f"fit: {checkpoint_dir} holds a run of another model ({saved.config}); this "
                    f"run's is {config}. Use another checkpoint_dir, or resume=False to start over "
                    "(its checkpoints are then replaced)."
                )
            model = placed(saved.model)
            opt_state = placed(fill_tree(opt_state, saved.state_arrays, what="optimizer state"))
            start_step = int(saved.state["step"])
            history = list(saved.state["history"])
            best = saved.state.get("best")

    train_step = make_train_step(optimizer, loss_fn, accumulate)
    root_key = jax.random.PRNGKey(seed)
    losses: list[jax.Array] = []
    bar = tqdm(
        total=steps,
        initial=start_step,
        disable=not progress or jax.process_index() != 0,
        unit="step",
        dynamic_ncols=True,
    )
    tick = time.perf_counter()
    for step in range(start_step, steps):
        batch = _batch_indices(seed, step, len(xs), batch_size)
        if mesh is None:
            xb, yb = jnp.asarray(xs[batch]), jnp.asarray(labels[batch])
        else:  # this process's slice of the global batch
            mine = _this_process(batch)
            xb, yb = global_batch(mesh, xs[mine]), global_batch(mesh, labels[mine])
        model, opt_state, loss = train_step(
            model, opt_state, xb, yb, jax.random.fold_in(root_key, step)
        )
        losses.append(loss)
        bar.update(1)
        done = step + 1
        # The previous step's loss is ready by now: checking it costs no wait on this one.
        if len(losses) > 1 and not math.isfinite(float(losses[-2])):
            bar.close()
            raise FloatingPointError(
                f"fit: the training loss is {float(losses[-2])} at step {done - 1}."
            )
        if done % eval_every and done != steps:
            continue
        train_loss = float(jnp.mean(jnp.stack(losses)))
        if not math.isfinite(train_loss):
            bar.close()
            raise FloatingPointError(f"fit: the training loss is {train_loss} at step {done}.")
        elapsed = time.perf_counter() - tick
        record = {
            "step": done,
            "train_loss": train_loss,
            "samples_per_s": len(losses) * batch_size / elapsed,
        }
        if valid is not None:
            metrics = _evaluate(model, valid[0], valid[1], 512, mesh, loss_fn)
            record.update({f"valid_{name}": value for name, value in metrics.items()})
        history.append(record)
        bar.set_postfix(
            loss=f"{train_loss:.4f}",
            **(
                {"valid_acc": f"{record['valid_accuracy']:.3f}"}
                if "valid_accuracy" in record
                else {}
            ),
            samples_s=f"{record['samples_per_s']:.0f}",
        )
        # the validation accuracy, else the validation loss (a custom loss), else the training loss
        score = record.get("valid_accuracy", -record.get("valid_loss", train_loss))
        improved = best is None or score > best["score"]
        if improved:
            best = {"score": score, **record}
        if checkpoint_dir is not None and config is not None:
            if improved and best_dir is not None:
                save_checkpoint(best_dir, model, config, state={"record": record})
            if last_dir is not None:
                save_checkpoint(
                    last_dir,
                    model,
                    config,
                    state_arrays=tree_arrays(opt_state),
                    state={"step": done, "history": history, "best": best, "seed": seed},
                )
        losses = []
        tick = time.perf_counter()
    bar.close()
    return FitResult(model, opt_state, history, best)
