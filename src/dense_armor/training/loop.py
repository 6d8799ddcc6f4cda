"""Training with optax on Equinox models: a jitted train step, evaluation, and a resumable fit loop.

The fit loop is reproducible from its seed: batch `s` and its dropout key are functions of
`(seed, s)` alone (`training.data`), so a run resumed from a checkpoint continues exactly as an
uninterrupted one. It reads its data through one protocol, a `BatchSource`; it places the model on
a mesh through `dense_armor.distributed`; it checkpoints to a single safetensors file
(`save_checkpoint`) or, sharded, with Orbax (`ShardedCheckpoints`).
"""

import dataclasses
import math
import os
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from ..checkpoints.single import (
    ModelConfig,
)
from ..distributed import global_batch, place, place_optimizer_state
from ..nn.core import require_bool, require_int
from ..nn.sharding import check_mesh
from .data import ArraySource, BatchSource, process_rows
from .losses import Loss, LossFn, as_loss, cross_entropy_loss
from .run_checkpoints import CHECKPOINT_FORMATS, RunCheckpoints
from .step import evaluate_checked, make_train_step

__all__ = ["FitResult", "fit"]


@dataclasses.dataclass
class FitResult:
    """The trained model, the optimizer state, and the history of evaluations."""

    model: Any
    opt_state: Any
    history: list[dict[str, float]]
    best: dict[str, float] | None


def _source(
    caller: str,
    model: Any,
    train: Any,
    batch_size: int,
    seed: int,
    mesh: Mesh | None,
    loss: Loss,
) -> BatchSource:
    """`train` as a `BatchSource`: arrays every process holds (checked whole, here), or a source
    already (its batches are checked as they come, by `_checked_batch`)."""
    if callable(train):
        return train
    if not isinstance(train, tuple | list) or len(train) != 2:
        raise TypeError(
            f"{caller}: `train` must be `(xs, labels)` or a BatchSource (a callable returning "
            f"this process's `(xs, labels)` of each step's batch); received "
            f"{type(train).__name__}."
        )
    xs, labels = np.asarray(train[0]), np.asarray(train[1])
    if len(xs) != len(labels):
        raise ValueError(f"{caller}: {len(xs)} inputs but {len(labels)} labels.")
    loss.check_data(caller, model, xs, labels)  # a custom loss may take other targets
    if not 1 <= batch_size <= len(xs):
        raise ValueError(f"{caller}: `batch_size={batch_size}` must lie in [1, {len(xs)}].")
    return ArraySource(xs, labels, batch_size, seed, mesh)


def _checked_batch(source: BatchSource, step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """`source(step)`, refused unless it is a pair `(xs, labels)` of the `rows` this process
    feeds (checked on the host, before the batch is sent)."""
    batch = source(step)
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise TypeError(
            f"fit: a data source must return this process's `(xs, labels)` of the batch it is "
            f"asked for (two arrays of as many rows); at step {step} it returned "
            f"{type(batch).__name__}"
            + (f" of {len(batch)} items." if isinstance(batch, tuple | list) else ".")
        )
    xs, labels = np.asarray(batch[0]), np.asarray(batch[1])
    if xs.ndim == 0 or labels.ndim == 0 or len(xs) != rows or len(labels) != rows:
        raise ValueError(
            f"fit: the data source gave {len(xs) if xs.ndim else 'a scalar as'} inputs and "
            f"{len(labels) if labels.ndim else 'a scalar as'} labels for step {step}; this "
            f"process feeds {rows} rows of each batch."
        )
    return xs, labels


def fit(
    model: Any,
    optimizer: optax.GradientTransformation,
    train: tuple[Any, Any] | BatchSource,
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
    accumulate: int | None = None,
    checkpoint_format: str = "safetensors",
) -> FitResult:
    """Train `model` for `steps` optimizer steps on `train`: `(xs, labels)`, or a `BatchSource`
    (`training.data`, e.g. `ShardSource`) that gives this process's rows of each step's global
    batch of `batch_size` rows. Every `eval_every` steps (and at the end) it records the mean
    training loss since the last record and, with `valid`, the validation loss and accuracy.

    With `checkpoint_dir` (and the model's `config`) it saves `last` (model, optimizer state,
    step, history) at each record and `best` whenever the validation accuracy improves (the
    training loss without `valid`); `resume=True` continues from `last`. `checkpoint_format`:
    `"safetensors"` (one file, gathered) or `"orbax"` (`checkpoint_dir/sharded`, each process its
    own shards, in the background; it resumes onto another mesh). A progress bar shows the loss
    and the samples per second on a terminal (tqdm's rule); `progress=False` turns it off.

    With a `mesh` (`data_mesh()` or `device_mesh(model=...)`), each batch is split over its
    `"data"` axis, heads and feed-forward units over its `"model"` axis, the other arrays
    replicated (or split over `"data"` with `shard_params=True`): the losses of one device, to
    float32 round-off; with several processes, each calls `fit` alike and feeds its own rows.
    `accumulate=k` accumulates the gradients of `k` micro-batches before one update (the same
    training, one micro-batch's activations in memory); `None` leaves `k` to `make_train_step`.
    """
    objective = as_loss(loss_fn)
    source, rows = _check_fit(
        model, train, valid, steps, batch_size, seed, eval_every, checkpoint_dir, config,
        resume, progress, objective, mesh, shard_params, accumulate, checkpoint_format,
    )  # fmt: skip
    checkpoints = None
    if checkpoint_dir is not None and config is not None:
        checkpoints = RunCheckpoints.open(checkpoint_dir, config, checkpoint_format)
    model, opt_state, run = _start(model, optimizer, mesh, shard_params, checkpoints, resume)
    plan = _Plan(steps, batch_size, seed, valid, eval_every, mesh, objective, source, rows)
    bar = _progress_bar(steps, run.start, progress)
    try:
        step = make_train_step(optimizer, objective, accumulate)
        model, opt_state = _steps(plan, step, model, opt_state, run, bar, checkpoints)
    finally:
        bar.close()
        if checkpoints is not None:
            checkpoints.close()
    return FitResult(model, opt_state, run.history, run.best)


def _progress_bar(steps: int, start: int, progress: bool) -> Any:
    """`fit`'s progress bar, on the first process, where standard error is a terminal."""
    return tqdm(
        total=steps, initial=start,
        disable=None if progress and jax.process_index() == 0 else True,  # None: on a terminal
        unit="step", dynamic_ncols=True,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a `fit` does at each step, checked: its settings, its loss, where its batches come
    from and how many rows of each this process feeds."""

    steps: int
    batch_size: int
    seed: int
    valid: Any
    eval_every: int
    mesh: Mesh | None
    objective: Loss
    source: BatchSource
    rows: int

    def batch(self, step: int, model: Any, check: Any) -> tuple[Any, Any, Any]:
        """Step `step`'s batch on the devices, and the checker of a source's batches (arrays
        were checked whole, in `_source`; a source's labels are checked batch by batch)."""
        xs, labels = _checked_batch(self.source, step, self.rows)
        if not isinstance(self.source, ArraySource):
            check = check or self.objective.batch_checker(model, xs)
            if check is not None:
                check("fit (data source)", xs, labels, self.rows, f" at step {step}")
        xb, yb = _placed(self.mesh, xs, labels)
        return xb, yb, check


def _steps(
    plan: _Plan, train_step: Any, model: Any, opt_state: Any, run: "_Run", bar: Any,
    checkpoints: "RunCheckpoints | None",
) -> tuple[Any, Any]:  # fmt: skip
    """`fit`'s steps from where `run` starts: each a batch and an update, a record every
    `eval_every` steps and at the end, saved with the optimizer state where there are
    checkpoints."""
    root_key, check = jax.random.PRNGKey(plan.seed), None
    run.tick = time.perf_counter()
    for step in range(run.start, plan.steps):
        xb, yb, check = plan.batch(step, model, check)
        with plan.objective.checked_inputs():  # every batch was checked: arrays whole, above
            model, opt_state, loss = train_step(
                model, opt_state, xb, yb, jax.random.fold_in(root_key, step)
            )
        run.losses.append(loss)
        bar.update(1)
        done = step + 1
        run.check_previous(done)
        if done % plan.eval_every and done != plan.steps:
            continue
        score, improved = run.record(
            done, plan.batch_size, model, plan.valid, plan.mesh, plan.objective, bar
        )
        if checkpoints is not None:
            state = {"step": done, "history": run.history, "best": run.best, "seed": plan.seed}
            checkpoints.save(model, opt_state, state, score, improved)
    return model, opt_state


def _check_fit(
    model: Any,
    train: Any,
    valid: Any,
    steps: Any,
    batch_size: Any,
    seed: Any,
    eval_every: Any,
    checkpoint_dir: Any,
    config: ModelConfig | None,
    resume: Any,
    progress: Any,
    objective: Loss,
    mesh: Mesh | None,
    shard_params: Any,
    accumulate: Any,
    checkpoint_format: Any,
) -> tuple[BatchSource, int]:
    """`fit`'s arguments checked, before any work: its batch source, and the rows of each batch
    this process feeds."""
    require_int(0, caller="fit", steps=steps, seed=seed)
    require_int(1, caller="fit", batch_size=batch_size, eval_every=eval_every)
    if accumulate is not None:
        require_int(1, caller="fit", accumulate=accumulate)
    require_bool(resume=resume, progress=progress, shard_params=shard_params)
    if mesh is not None:
        check_mesh("fit", mesh)
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"fit: `checkpoint_format` must be one of {CHECKPOINT_FORMATS}; received "
            f"{checkpoint_format!r}."
        )
    source = _source("fit", model, train, batch_size, seed, mesh, objective)
    if valid is not None:
        objective.check_data("fit (valid)", model, *valid)
    if checkpoint_dir is not None and config is None:
        raise ValueError("fit: saving checkpoints needs the model's `config`.")
    if accumulate is not None:
        _check_micro_batches(accumulate, batch_size, mesh)
    return source, len(range(batch_size)[process_rows(mesh, batch_size)])


def _check_micro_batches(accumulate: int, batch_size: int, mesh: Mesh | None) -> None:
    """An explicit `accumulate`: equal micro-batches, each a multiple of the data devices."""
    if batch_size % accumulate:
        raise ValueError(
            f"fit: `accumulate={accumulate}` micro-batches must divide `batch_size={batch_size}`."
        )
    data_devices = 1 if mesh is None else mesh.shape["data"]
    if (batch_size // accumulate) % data_devices:
        raise ValueError(
            f"fit: each of the {accumulate} micro-batches (`batch_size={batch_size}` in all) must "
            f'be a multiple of the mesh\'s {data_devices} `"data"` devices.'
        )


def _placed(mesh: Mesh | None, xs: Any, labels: Any) -> tuple[jax.Array, jax.Array]:
    """A batch on the device, or, with a mesh, this process's rows of the global batch."""
    if mesh is None:
        return jnp.asarray(xs), jnp.asarray(labels)
    return global_batch(mesh, xs), global_batch(mesh, labels)


@dataclasses.dataclass
class _Run:
    """Where a `fit` stands: its first step (after a resume), its records, the best of them, and
    the losses since the last record and when that was."""

    start: int = 0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    best: dict[str, float] | None = None
    losses: list[jax.Array] = dataclasses.field(default_factory=list)
    tick: float = dataclasses.field(default_factory=time.perf_counter)

    def check_previous(self, done: int) -> None:
        """Refuse a non-finite loss of the step before `done`: it is ready by now, so checking it
        costs no wait on the step just dispatched."""
        if len(self.losses) > 1 and not math.isfinite(float(self.losses[-2])):
            raise FloatingPointError(
                f"fit: the training loss is {float(self.losses[-2])} at step {done - 1}."
            )

    def record(
        self,
        done: int,
        batch_size: int,
        model: Any,
        valid: Any,
        mesh: Mesh | None,
        objective: Loss,
        bar: Any,
    ) -> tuple[float, bool]:
        """Record step `done`: the mean training loss since the last record, the throughput and,
        with `valid`, the validation metrics; show them on the progress bar. Returns the record's
        score (the validation accuracy, else minus the validation loss of a custom loss, else
        minus the training loss) and whether it is the best so far."""
        train_loss = float(jnp.mean(jnp.stack(self.losses)))
        if not math.isfinite(train_loss):
            raise FloatingPointError(f"fit: the training loss is {train_loss} at step {done}.")
        record = {
            "step": done,
            "train_loss": train_loss,
            "samples_per_s": len(self.losses) * batch_size / (time.perf_counter() - self.tick),
        }
        if valid is not None:
            metrics = evaluate_checked(model, valid[0], valid[1], 512, mesh, objective)
            record.update({f"valid_{name}": value for name, value in metrics.items()})
        self.history.append(record)
        accuracy = (
            {"valid_acc": f"{record['valid_accuracy']:.3f}"} if "valid_accuracy" in record else {}
        )
        bar.set_postfix(
            loss=f"{train_loss:.4f}", **accuracy, samples_s=f"{record['samples_per_s']:.0f}"
        )
        score = record.get("valid_accuracy", -record.get("valid_loss", train_loss))
        improved = self.best is None or score > self.best["score"]
        if improved:
            self.best = {"score": score, **record}
        self.losses, self.tick = [], time.perf_counter()
        return score, improved


def _start(
    model: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh | None,
    shard_params: bool,
    checkpoints: "RunCheckpoints | None",
    resume: bool,
) -> tuple[Any, Any, _Run]:
    """The model and optimizer state placed on the mesh, or resumed from `checkpoints` (a run
    that does not resume starts them over); and where the run starts."""
    if mesh is not None:
        model = place(model, mesh, shard_params)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    if mesh is not None:
        opt_state = place_optimizer_state(opt_state, optimizer, model, mesh)
    if checkpoints is None:
        return model, opt_state, _Run()
    if resume and checkpoints.saved():
        model, opt_state, state = checkpoints.resume(opt_state, optimizer, mesh, shard_params)
        run = _Run(int(state["step"]), list(state["history"]), state.get("best"))
        return model, opt_state, run
    if not resume:
        checkpoints.start_over()
    return model, opt_state, _Run()
