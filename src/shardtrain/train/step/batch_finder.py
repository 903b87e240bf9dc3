"""`auto_find_batch_size`, past Hugging Face's: when a step runs out of memory, the per-device batch is cut (halved,
or to the next size that divides it) and the accumulation steps grow by the same factor, so the global batch, the
samples of every step and the loss trajectory stay those of a run that never had to (Hugging Face halves the batch
and so changes the global batch).

    smaller = smaller_batch(current=16, configured=16)   # 8: 2x the accumulation steps
"""

from __future__ import annotations

from shardtrain.errors import TrainingArgumentsError

__all__ = ["out_of_memory", "smaller_batch"]


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` says a device (or the host) ran out of memory (Accelerate's rule, which transformers uses)."""
    from accelerate.utils.memory import should_reduce_batch_size  # (imported when needed: the XLA venv has none)

    return isinstance(err, MemoryError) or should_reduce_batch_size(err)


def smaller_batch(current: int, configured: int) -> int:
    """The next per-device batch below `current` that divides the configured one (so the accumulation steps grow
    by a whole factor and the global batch stays the same).

    Raises:
        TrainingArgumentsError: `current` is 1 already.
    """
    smaller = next((size for size in range(current // 2, 0, -1) if configured % size == 0), None)
    if smaller is None:
        raise TrainingArgumentsError(
            "auto_find_batch_size: a step ran out of memory with 1 sample per device; nothing smaller is left. Use "
            "less memory per sample (shorter sequences, activation_checkpointing, fsdp_config cpu offload) or more "
            "ranks")
    return smaller
