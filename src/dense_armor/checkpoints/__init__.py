"""How models are stored: a checkpoint directory (a config's JSON and safetensors weights, written
atomically: `single`), Orbax's sharded checkpoints for meshes and several processes (`sharded`,
the `scale` extra, imported on its own), the trees of arrays both read and write (`trees`), and the
registry of model families a config names (`families`).

    from dense_armor.checkpoints import ModelConfig, load_checkpoint, save_checkpoint
    from dense_armor.checkpoints.sharded import ShardedCheckpoints
"""

from .families import FAMILIES, Family, family
from .single import (
    Checkpoint,
    ModelConfig,
    convert_layers,
    load_checkpoint,
    save_checkpoint,
)
from .trees import CheckpointError, fill_tree, skeleton, tree_arrays

__all__ = [
    "FAMILIES",
    "Checkpoint",
    "CheckpointError",
    "Family",
    "ModelConfig",
    "convert_layers",
    "family",
    "fill_tree",
    "load_checkpoint",
    "save_checkpoint",
    "skeleton",
    "tree_arrays",
]
