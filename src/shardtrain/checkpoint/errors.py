"""Checkpoint errors: every message names the file or key and what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded as asked."""
