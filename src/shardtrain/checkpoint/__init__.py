"""Checkpoints: atomic save/load/rotate (manager), full safetensors export, offline merge."""

from shardtrain.checkpoint.errors import CheckpointError
from shardtrain.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager"]
