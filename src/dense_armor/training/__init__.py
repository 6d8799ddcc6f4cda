"""How models are trained: `fit` (the resumable loop, `loop`), the jitted train step and
evaluation (`step`), the losses a step minimises (`losses`), where batches come from (`data`), and
a run's checkpoints (`run_checkpoints`: single files or Orbax).

    from dense_armor.training import fit, evaluate, next_token_loss
"""

from .data import ArraySource, BatchSource, ShardSource, process_rows
from .loop import FitResult, fit
from .losses import (
    CrossEntropy,
    Loss,
    LossFn,
    NextToken,
    as_loss,
    cross_entropy_loss,
    next_token_loss,
    next_token_loss_balanced,
)
from .run_checkpoints import CHECKPOINT_FORMATS, RunCheckpoints
from .step import evaluate, make_train_step

__all__ = [
    "CHECKPOINT_FORMATS",
    "ArraySource",
    "BatchSource",
    "CrossEntropy",
    "FitResult",
    "Loss",
    "LossFn",
    "NextToken",
    "RunCheckpoints",
    "ShardSource",
    "as_loss",
    "cross_entropy_loss",
    "evaluate",
    "fit",
    "make_train_step",
    "next_token_loss",
    "next_token_loss_balanced",
    "process_rows",
]
