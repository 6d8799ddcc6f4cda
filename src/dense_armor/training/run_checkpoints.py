"""Where `fit` keeps its run: one protocol (`RunCheckpoints`) and a class per checkpoint format,
single safetensors files (`SingleFiles`) or Orbax's sharded checkpoints (`OrbaxCheckpoints`)."""

import abc
import pathlib
from typing import Any

from jax.sharding import Mesh

from ..checkpoints.single import (
    CheckpointError,
    ModelConfig,
    fill_tree,
    load_checkpoint,
    save_checkpoint,
    tree_arrays,
)
from ..distributed import place, place_optimizer_state

__all__ = ["CHECKPOINT_FORMATS", "OrbaxCheckpoints", "RunCheckpoints", "SingleFiles"]

CHECKPOINT_FORMATS = ("safetensors", "orbax")


class RunCheckpoints(abc.ABC):
    """Where `fit` keeps its run, one class per format of `CHECKPOINT_FORMATS`: whether a run is
    saved, resuming it, forgetting it, saving a record, and waiting for the saves. What both
    formats share (the checks that a saved run is this model's and a training run's) is here."""

    def __init__(self, directory: Any, config: ModelConfig):
        self.directory = pathlib.Path(directory)
        self.config = config

    @staticmethod
    def open(directory: Any, config: ModelConfig, checkpoint_format: str) -> "RunCheckpoints":
        kind = {"safetensors": SingleFiles, "orbax": OrbaxCheckpoints}[checkpoint_format]
        return kind(directory, config)

    @abc.abstractmethod
    def saved(self) -> bool:
        """Whether the directory holds a run to resume."""

    @abc.abstractmethod
    def resume(
        self, opt_state: Any, optimizer: Any, mesh: Mesh | None, shard_params: bool
    ) -> tuple[Any, Any, dict[str, Any]]:
        """The saved model, optimizer state and training state, placed like this run's."""

    @abc.abstractmethod
    def start_over(self) -> None:
        """Forget an earlier run (`resume=False`)."""

    @abc.abstractmethod
    def save(
        self, model: Any, opt_state: Any, state: dict[str, Any], score: float, improved: bool
    ) -> None:
        """Save the latest record (and the best model, when `improved`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for the saves still being written."""

    def _check(self, saved: ModelConfig) -> None:
        if saved != self.config:
            raise CheckpointError(
                f"fit: {self.directory} holds a run of another model ({saved}); this run's "
                f"is {self.config}. Use another checkpoint_dir, or resume=False to start over "
                "(its checkpoints are then replaced)."
            )

    def _check_run(self, state: dict[str, Any], has_optimizer_state: bool) -> None:
        """A checkpoint to resume from holds a training run: its step, history and optimizer
        state (a model saved alone, or converted without its optimizer, does not)."""
        if not has_optimizer_state or "step" not in state or "history" not in state:
            raise CheckpointError(
                f"fit: the latest checkpoint in {self.directory} is not a training run's (no "
                "optimizer state, step and history to resume from); use another checkpoint_dir, "
                "or resume=False to start over."
            )


class SingleFiles(RunCheckpoints):
    """`"safetensors"`: `last` (model, optimizer state, step, history) and `best` (the model),
    single files gathered and written by process 0."""

    def __init__(self, directory: Any, config: ModelConfig):
        super().__init__(directory, config)
        self.last, self.best = self.directory / "last", self.directory / "best"

    def saved(self) -> bool:
        return self.last.exists() or self.last.with_name("last.previous").exists()

    def resume(
        self, opt_state: Any, optimizer: Any, mesh: Mesh | None, shard_params: bool
    ) -> tuple[Any, Any, dict[str, Any]]:
        saved = load_checkpoint(self.last)
        self._check(saved.config)
        self._check_run(saved.state, bool(saved.state_arrays))
        model = saved.model
        saved_opt = fill_tree(opt_state, saved.state_arrays, what="optimizer state")
        if mesh is not None:  # read whole, as the single file holds it
            model = place(model, mesh, shard_params)
            saved_opt = place_optimizer_state(saved_opt, optimizer, model, mesh)
        return model, saved_opt, saved.state

    def start_over(self) -> None:
        """Nothing to forget: the next save replaces the files."""

    def close(self) -> None:
        """Nothing to wait for: each save is written before `save` returns."""

    def save(
        self, model: Any, opt_state: Any, state: dict[str, Any], score: float, improved: bool
    ) -> None:
        if improved:
            save_checkpoint(self.best, model, self.config, state={"record": state["history"][-1]})
        save_checkpoint(
            self.last, model, self.config, state_arrays=tree_arrays(opt_state), state=state
        )


class OrbaxCheckpoints(RunCheckpoints):
    """`"orbax"`: one `ShardedCheckpoints` directory, `sharded`, keeping the latest step and the
    best, each process writing its own shards in the background."""

    def __init__(self, directory: Any, config: ModelConfig):
        super().__init__(directory, config)
        try:
            from ..checkpoints.sharded import ShardedCheckpoints
        except ImportError as error:
            raise ImportError(
                'fit: `checkpoint_format="orbax"` needs Orbax: pip install '
                f"'dense-armor[scale]' (orbax-checkpoint). ({error})"
            ) from None
        self.store = ShardedCheckpoints(self.directory / "sharded", keep_best=True)

    def saved(self) -> bool:
        return self.store.latest_step() is not None

    def resume(
        self, opt_state: Any, optimizer: Any, mesh: Mesh | None, shard_params: bool
    ) -> tuple[Any, Any, dict[str, Any]]:
        self._check(ModelConfig.from_json(self.store.config_json()))
        restored = self.store.restore(mesh=mesh, shard_params=shard_params, optimizer=optimizer)
        self._check_run(restored.state, restored.opt_state is not None)
        return restored.model, restored.opt_state, restored.state

    def start_over(self) -> None:
        self.store.delete_all()

    def save(
        self, model: Any, opt_state: Any, state: dict[str, Any], score: float, improved: bool
    ) -> None:
        self.store.save(
            state["step"], model, self.config, opt_state=opt_state, state=state, score=score
        )

    def close(self) -> None:
        self.store.close()
