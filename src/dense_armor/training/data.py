"""Where `fit`'s batches come from, and which rows of each batch this process feeds.

`fit` reads its training data through one protocol, a `BatchSource`: a callable that, given the
step, returns this process's rows of that step's global batch, `(xs, labels)` as NumPy. It is a
function of the step alone, so a run resumed from a checkpoint reads what an uninterrupted one
would have read. Two sources come with the library:

- `ArraySource`: a data set that every process holds whole (what `fit` makes of `train=(xs,
  labels)`): global batch `s` is the `s`-th slice of a per-epoch shuffle seeded by `(seed,
  epoch)`, and each process takes only its rows of it.
- `ShardSource`: the part of a data set that this process holds alone (its own files, its own
  rows): batch `s` is the `s`-th slice of a per-epoch shuffle of those rows, seeded by `(seed,
  part, epoch)`. The global batch is the processes' batches in process order; no process ever
  reads another's rows.

Any other callable with the same contract serves (a reader of this process's files, a
tf.data or Grain pipeline sharded by `jax.process_index()`). Which rows of a global batch are this
process's is `process_rows(mesh, n)`: the rows of the mesh's `"data"` axis that its devices hold.
"""

import itertools
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..nn.core import require_int

__all__ = ["ArraySource", "BatchSource", "ShardSource", "process_rows"]


class BatchSource(Protocol):
    """`source(step) -> (xs, labels)`: this process's rows of global batch `step` (all of it
    without a mesh or with one process), the same for the same `step` every time it is asked."""

    def __call__(self, step: int) -> tuple[Any, Any]: ...


def process_rows(mesh: Mesh | None, n: int) -> slice:
    """The rows of a global batch of `n` rows that this process feeds when the batch is split
    over `mesh`'s `"data"` axis (`jax.make_array_from_process_local_data` takes them in that
    order): all `n` without a mesh. `n` must be a multiple of the `"data"` axis."""
    if mesh is None or jax.process_count() == 1:
        return slice(0, n)
    held = NamedSharding(mesh, P("data")).addressable_devices_indices_map((n,)).values()
    spans = [index[0] for index in held if index is not None]
    starts = sorted({(rows.start or 0, rows.stop or n) for rows in spans})
    for (_, stop), (start, _) in itertools.pairwise(starts):
        if stop != start:
            raise ValueError(
                "this process's devices hold rows of the batch that are not contiguous; build "
                'the mesh with each process\'s devices on whole rows of its `"data"` axis '
                "(`device_mesh` does, when `model` divides a process's device count)."
            )
    return slice(starts[0][0], starts[-1][1])


def epoch_batch(seed: int | list[int], step: int, n: int, batch_size: int) -> np.ndarray:
    """The row indices of batch `step`: the `step`-th slice of `batch_size` rows of a shuffle of
    `range(n)`, drawn anew each epoch from `(seed, epoch)` (the last partial slice is skipped)."""
    per_epoch = n // batch_size
    epoch, within = divmod(step, per_epoch)
    seeds = [*seed, epoch] if isinstance(seed, list) else [seed, epoch]
    order = np.random.default_rng(seeds).permutation(n)
    return order[within * batch_size : (within + 1) * batch_size]


class ArraySource:
    """A data set `(xs, labels)` that every process holds whole, in global batches of
    `batch_size` rows (`epoch_batch` with `seed`); each process reads only its rows of each
    (`process_rows` on `mesh`)."""

    def __init__(
        self, xs: Any, labels: Any, batch_size: int, seed: int = 0, mesh: Mesh | None = None
    ):
        if len(xs) != len(labels):
            raise ValueError(f"ArraySource: {len(xs)} inputs but {len(labels)} labels.")
        require_int(1, caller="ArraySource", batch_size=batch_size)
        require_int(0, caller="ArraySource", seed=seed)
        if not batch_size <= len(xs):
            raise ValueError(
                f"ArraySource: `batch_size={batch_size}` must lie in [1, {len(xs)}], the rows "
                "of the data set."
            )
        self.xs, self.labels = xs, labels
        self.batch_size, self.seed, self.mesh = int(batch_size), int(seed), mesh

    def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        batch = epoch_batch(self.seed, step, len(self.xs), self.batch_size)
        mine = batch[process_rows(self.mesh, len(batch))]
        return np.asarray(self.xs[mine]), np.asarray(self.labels[mine])


class ShardSource:
    """The rows `(xs, labels)` that this process holds alone, in batches of `batch_size` (this
    process's share of each global batch): batch `step` is the `step`-th slice of a shuffle of
    these rows drawn each epoch from `(seed, part, epoch)`. `part` is this process's index by
    default; give it to build one process's source elsewhere (a test, a single-host replay)."""

    def __init__(
        self, xs: Any, labels: Any, batch_size: int, *, seed: int = 0, part: int | None = None
    ):
        if len(xs) != len(labels):
            raise ValueError(f"ShardSource: {len(xs)} inputs but {len(labels)} labels.")
        require_int(1, caller="ShardSource", batch_size=batch_size)
        require_int(0, caller="ShardSource", seed=seed)
        if part is not None:
            require_int(0, caller="ShardSource", part=part)
        if not batch_size <= len(xs):
            raise ValueError(
                f"ShardSource: `batch_size={batch_size}` must lie in [1, {len(xs)}], the rows "
                "this process holds."
            )
        self.xs, self.labels = xs, labels
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.part = jax.process_index() if part is None else int(part)

    def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        batch = epoch_batch([self.seed, self.part], step, len(self.xs), self.batch_size)
        return np.asarray(self.xs[batch]), np.asarray(self.labels[batch])
