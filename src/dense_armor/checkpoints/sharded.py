"""Sharded checkpoints with Orbax: each process writes the shards its devices hold, in the
background, and a checkpoint restores onto any mesh.

`save_checkpoint` (`checkpoints.single`) gathers the whole model and optimizer state onto every
process and writes one safetensors file: right for small models and for export, wrong for a
model that does not fit one host. `ShardedCheckpoints(directory)` keeps a directory of sharded
checkpoints, one per saved step, through Orbax's `CheckpointManager` (no format of our own):

- `save(step, model, config, opt_state=..., state=...)`: every process calls it; each writes its
  own shards (Orbax's OCDBT/Zarr layout), the config and the training state as JSON. With
  `asynchronous=True` (the default) it returns once the arrays are copied off the devices and
  writes in a background thread; the next save, `wait()` or `close()` waits for it. A checkpoint
  becomes visible only when complete (Orbax commits it by renaming).
- `restore(mesh=..., shard_params=..., optimizer=...)`: the latest (or a given) step, each array
  read straight into the sharding `dense_armor.distributed` gives it on `mesh` (any mesh, of any
  shape: written on 2 x 2, read on 4 x 1 or on one device), the model rebuilt from its config.
- `to_safetensors` and `from_safetensors` convert to and from the single-file checkpoint.

`fit(..., checkpoint_format="orbax")` saves and resumes through this.
"""

import dataclasses
import os
import pathlib
from typing import Any

import equinox as eqx
import jax
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, SingleDeviceSharding

from ..distributed import optimizer_shardings
from ..nn.core import require_bool, require_int
from ..nn.sharding import check_mesh, is_slot, shardings
from .single import (
    CheckpointError,
    ModelConfig,
    check_fits,
    fill_tree,
    load_checkpoint,
    save_checkpoint,
    skeleton,
    tree_arrays,
)

__all__ = ["ShardedCheckpoints", "ShardedRestore", "from_safetensors", "to_safetensors"]


@dataclasses.dataclass
class ShardedRestore:
    """What `ShardedCheckpoints.restore` returns."""

    step: int
    model: Any
    config: ModelConfig
    opt_state: Any  # None when no optimizer was asked for, or none was saved
    state: dict[str, Any]


def _abstract(tree: Any, where: Any) -> Any:
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s carrying the shardings `where` gives them."""
    return jax.tree.map(
        lambda leaf, sharding: (
            None
            if sharding is None
            else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        ),
        tree,
        where,
        is_leaf=lambda x: x is None,
    )


class ShardedCheckpoints:
    """A directory of sharded checkpoints, one per saved step, keeping the newest `max_to_keep`
    (`None`: all) and, with `keep_best`, also the one saved with the highest `score`. See the
    module's docstring."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 1,
        keep_best: bool = False,
        asynchronous: bool = True,
    ):
        if max_to_keep is not None:
            require_int(1, caller="ShardedCheckpoints (or None)", max_to_keep=max_to_keep)
            max_to_keep = int(max_to_keep)
        require_bool(keep_best=keep_best, asynchronous=asynchronous)
        self.directory = pathlib.Path(directory).absolute()
        if self.directory.is_file():
            raise CheckpointError(f"{self.directory} is a file, not a checkpoint directory.")
        policies = ocp.checkpoint_managers
        keep: list[Any] = [policies.LatestN(max_to_keep)]
        if keep_best:
            keep.append(
                policies.BestN(
                    get_metric_fn=lambda m: m["score"], n=1, keep_checkpoints_without_metrics=False
                )
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep),
            best_fn=lambda m: m["score"],
            best_mode="max",
            enable_async_checkpointing=asynchronous,
            create=True,
            # Orbax names its cross-process barriers by step; the directory's name keeps two
            # stores saving the same step apart.
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=f"dense_armor:{self.directory.name}"
            ),
        )
        handlers = {
            "model": ocp.StandardCheckpointHandler(),
            "optimizer": ocp.StandardCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "state": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def best_step(self) -> int | None:
        """The step saved with the highest `score` (None if none was saved with one)."""
        self._manager.wait_until_finished()
        return (
            self._manager.best_step()
            if any(self._manager.metrics(s) for s in self.steps())
            else None
        )

    def steps(self) -> list[int]:
        """The steps saved (and complete), oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        model: Any,
        config: ModelConfig,
        *,
        opt_state: Any = None,
        state: dict[str, Any] | None = None,
        score: float | None = None,
    ) -> None:
        """Save `model` (and an optimizer state, a JSON-able training state, and the `score`
        that `keep_best` ranks by) as `step`. Every process calls it; each writes the shards of
        its own devices."""
        require_int(0, caller="ShardedCheckpoints.save", step=step)
        step = int(step)
        if not isinstance(config, ModelConfig):
            raise TypeError(
                f"ShardedCheckpoints.save: `config` must be a ModelConfig; received "
                f"{type(config).__name__}."
            )
        arrays = eqx.filter(model, eqx.is_array)
        leaves = jax.tree_util.tree_leaves_with_path(arrays)  # shapes only: nothing is gathered
        check_fits(
            config,
            {jax.tree_util.keystr(path): leaf for path, leaf in leaves},
            what=f"arrays of the model saved to {self.directory}",
        )
        items = {
            "model": ocp.args.StandardSave(arrays),
            "config": ocp.args.JsonSave(config.to_json()),
            "state": ocp.args.JsonSave(dict(state or {})),
        }
        if opt_state is not None:
            items["optimizer"] = ocp.args.StandardSave(opt_state)
        metrics = None if score is None else {"score": float(score)}
        self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)

    def restore(
        self,
        step: int | None = None,
        *,
        mesh: Mesh | None = None,
        shard_params: bool = False,
        optimizer: optax.GradientTransformation | None = None,
    ) -> ShardedRestore:
        """The checkpoint of `step` (default: the latest), each array read into its sharding on
        `mesh` (`dense_armor.distributed.shardings`; without a mesh, onto this process's first
        device). With `optimizer`, the optimizer state too, sharded like its parameters."""
        step = self._step(step)
        meta = self._read(
            step,
            args=ocp.args.Composite(config=ocp.args.JsonRestore(), state=ocp.args.JsonRestore()),
        )
        config = _config(meta["config"], self.directory)
        model_like = skeleton(config)
        one = SingleDeviceSharding(jax.local_devices()[0])  # without a mesh, every array here
        if mesh is None:
            where = jax.tree.map(
                lambda leaf: one if is_slot(leaf) else None, model_like, is_leaf=is_slot
            )
        else:
            check_mesh("ShardedCheckpoints.restore", mesh)
            where = shardings(model_like, mesh, shard_params)
        items = {"model": ocp.args.StandardRestore(_abstract(model_like, where))}
        if optimizer is not None and self.has_optimizer_state(step):
            params_like = eqx.filter(model_like, _inexact)
            opt_like = jax.eval_shape(optimizer.init, params_like)
            param_where = jax.tree.map(
                lambda leaf, sharding: None if leaf is None else sharding,
                params_like,
                where,
                is_leaf=lambda x: x is None,
            )
            if mesh is None:
                opt_where = jax.tree.map(lambda _: one, opt_like)
            else:
                opt_where = optimizer_shardings(opt_like, optimizer, param_where, mesh)
            items["optimizer"] = ocp.args.StandardRestore(_abstract(opt_like, opt_where))
        restored = self._read(step, args=ocp.args.Composite(**items))
        return ShardedRestore(
            step=step,
            model=eqx.combine(restored["model"], model_like),
            config=config,
            opt_state=restored["optimizer"] if "optimizer" in items else None,
            state=dict(meta["state"]),
        )

    def config_json(self, step: int | None = None) -> Any:
        """The JSON of the config saved with `step` (default the latest)."""
        step = self._step(step)
        meta = self._read(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return meta["config"]

    def has_optimizer_state(self, step: int) -> bool:
        """Whether the checkpoint of `step` holds an optimizer state."""
        saved = self._manager.item_metadata(step)
        return saved is not None and saved.get("optimizer") is not None

    def _read(self, step: int, args: Any) -> Any:
        """Orbax's restore, its failures (a missing or truncated file) as `CheckpointError`."""
        try:
            return self._manager.restore(step, args=args)
        except (ValueError, OSError, KeyError) as error:
            first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
            raise CheckpointError(
                f"cannot read the sharded checkpoint of step {step} in {self.directory}: {first}"
            ) from None

    def delete_all(self) -> None:
        """Delete every saved step (a run started over)."""
        self._manager.wait_until_finished()
        for step in self.steps():
            self._manager.delete(step)

    def _step(self, step: int | None) -> int:
        """`step`, or the latest, once every save has been written; refused if not saved."""
        self._manager.wait_until_finished()
        step = self.latest_step() if step is None else step
        if step is None or step not in self.steps():
            raise CheckpointError(
                f"no sharded checkpoint of step {step} in {self.directory} "
                f"(saved steps: {self.steps()})."
            )
        return step

    def wait(self) -> None:
        """Return once every save started has been written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "ShardedCheckpoints":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _config(data: Any, where: pathlib.Path) -> ModelConfig:
    try:
        return ModelConfig.from_json(data)
    except CheckpointError as error:
        raise CheckpointError(f"{where}: {error}") from None


def _inexact(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct) and jax.numpy.issubdtype(
        leaf.dtype, jax.numpy.inexact
    )


def to_safetensors(
    sharded: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> pathlib.Path:
    """Write the sharded checkpoint of `step` (default the latest) in `sharded` as a
    single-file checkpoint `out` (`save_checkpoint`): the model, the training state, and the
    optimizer state, for which the `optimizer` that made it is needed (its structure is the
    optimizer's). `fit` resumes from either form."""
    with ShardedCheckpoints(sharded, max_to_keep=None, asynchronous=False) as store:
        step = store.latest_step() if step is None else step
        if step is not None and store.has_optimizer_state(step) and optimizer is None:
            raise CheckpointError(
                f"to_safetensors: the checkpoint of step {step} holds an optimizer state; pass "
                "the `optimizer` that made it, so that it is kept."
            )
        restored = store.restore(step, optimizer=optimizer)
    return save_checkpoint(
        out,
        restored.model,
        restored.config,
        state_arrays=None if restored.opt_state is None else tree_arrays(restored.opt_state),
        state={"step": restored.step, **restored.state},
    )


def from_safetensors(
    checkpoint: str | os.PathLike[str],
    sharded: str | os.PathLike[str],
    *,
    optimizer: optax.GradientTransformation | None = None,
) -> int:
    """Save the single-file checkpoint `checkpoint` into the sharded directory `sharded`, as the
    step its training state records (0 without one); its optimizer state too, for which the
    `optimizer` that made it is needed. Returns the step."""
    saved = load_checkpoint(checkpoint)
    opt_state = None
    if saved.state_arrays:
        if optimizer is None:
            raise CheckpointError(
                f"from_safetensors: {checkpoint} holds an optimizer state; pass the `optimizer` "
                "that made it, so that it is kept."
            )
        like = optimizer.init(eqx.filter(saved.model, eqx.is_inexact_array))
        opt_state = fill_tree(like, saved.state_arrays, what="optimizer state")
    step = int(saved.state.get("step", 0))
    with ShardedCheckpoints(sharded, max_to_keep=None, asynchronous=False) as store:
        store.save(step, saved.model, saved.config, opt_state=opt_state, state=saved.state)
    return step
