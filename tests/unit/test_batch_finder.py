"""auto_find_batch_size's rule: the per-device batch shrinks to sizes that divide the configured one, so the
accumulation steps grow by a whole factor; out-of-memory errors are recognised as Accelerate recognises them."""

import pytest
import torch

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.step.batch_finder import out_of_memory, smaller_batch


def test_the_batch_halves_or_takes_the_next_divisor():
    assert smaller_batch(16, 16) == 8 and smaller_batch(8, 16) == 4 and smaller_batch(2, 16) == 1
    assert smaller_batch(6, 6) == 3 and smaller_batch(3, 6) == 1  # never a size whose accumulation is fractional
    assert smaller_batch(12, 12) == 6 and smaller_batch(6, 12) == 3


def test_one_sample_per_device_is_the_end_with_the_fix():
    with pytest.raises(TrainingArgumentsError, match="1 sample per device.*activation_checkpointing"):
        smaller_batch(1, 8)


def test_out_of_memory_errors_are_recognised():
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not out_of_memory(RuntimeError("shape mismatch"))
    assert not out_of_memory(ValueError("CUDA out of memory."))
