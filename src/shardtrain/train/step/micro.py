"""`MicroStep`: one micro-batch of an optimizer step and the facts its forward and backward need, in one
immutable object. `OptimizerStep` makes it, hands it to its hooks and holds it as the loss's `current`
micro-step while the hooks run (`LossComputer.running`): code with Hugging Face's signatures (`training_step`, a
library's `compute_loss`, Accelerate's `gather_for_metrics`) cannot be handed it, so it reads it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class MicroStep:
    """One micro-batch of an optimizer step, with the facts its forward and backward need.

    Attributes:
        batch: the model inputs (or a library's own batch).
        index: its place in the step (0-based), of `count`.
        count: the step's micro-batches.
        num_items: the global batch's target tokens (or samples); None for a library's batches, whose loss is
            its own mean.
        grad_scale: the backward of the loss *sum* is scaled by it (1 / global targets x the gradient average).
        placeholder: it stands in for no sample (an epoch's short end): forward and backward, weight 0.
    """

    batch: Any
    index: int
    count: int
    num_items: torch.Tensor | None
    grad_scale: float
    placeholder: bool = False

    @property
    def is_last(self) -> bool:
        """The step's last micro-batch (gradients are reduced after it; Accelerate's `sync_gradients`)."""
        return self.index == self.count - 1


# evaluation's placeholder batch (a rank's short share): a forward for FSDP's collectives that weighs nothing
EVAL_PLACEHOLDER = MicroStep(batch=None, index=0, count=1, num_items=None, grad_scale=0.0, placeholder=True)
