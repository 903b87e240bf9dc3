"""Checkpoint errors: every message names the file or key and what to do."""

from shardtrain.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or loaded as asked."""

    agreed = False  # may concern one rank's files; set True where every rank raises it together
