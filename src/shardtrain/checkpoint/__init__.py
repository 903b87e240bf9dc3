"""Checkpoints: atomic save/load/rotate (manager), full safetensors export, offline merge."""

from shardtrain.errors import CheckpointError

__all__ = ["CheckpointError"]
