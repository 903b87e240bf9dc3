"""The step's loss in the engine's units and in Hugging Face's: the one place that converts between them.

The engine's unit is the token sum: a micro-batch's loss summed over its target tokens (or samples, for a model
trained on its own loss). The step's loss is the sum over every micro-batch of every rank divided by the global
count `num_items_in_batch`, known before the first forward, so any split of the global batch gives one process's
loss.

Hugging Face's `compute_loss` returns a micro-batch's share of that loss times a factor: with
`average_tokens_across_devices` (its default), the ranks with distinct data, since DDP then averages the
gradients over them (tensor-parallel ranks and pipeline stages share their data). `training_step` returns the
same share. A library's `compute_loss` that applies the factor itself (TRL's) therefore trains exactly here too.

    units = LossUnits.of(world_size=4, copies=1, average_tokens_across_devices=True)
    hf_loss = units.hf(loss_sum / num_items)      # what compute_loss / training_step return
    loss_sum = units.to_sum(hf_loss, num_items)   # back to the engine's unit (backward, logging)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LossUnits:
    """Hugging Face's factor `scale` on a loss normalised by the global `num_items_in_batch`."""

    scale: int = 1

    @classmethod
    def of(cls, *, world_size: int, copies: int, average_tokens_across_devices: bool) -> LossUnits:
        """`copies`: ranks that read the same samples (tensor-parallel ranks of every pipeline stage)."""
        return cls(world_size // copies if average_tokens_across_devices else 1)

    def hf(self, per_item: Any) -> Any:
        """A loss per item of the global batch (sum / num_items) in Hugging Face's units."""
        return per_item * self.scale

    def to_sum(self, hf_loss: Any, num_items: Any) -> Any:
        """A loss in Hugging Face's units back to the token sum it stands for."""
        return hf_loss * num_items / self.scale

    def from_sum(self, loss_sum: Any, num_items: Any) -> Any:
        """A token sum as Hugging Face's `training_step` returns it."""
        return self.hf(loss_sum / num_items)
