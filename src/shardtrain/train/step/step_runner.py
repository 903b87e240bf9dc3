"""One optimizer step over its micro-batches: the gradient synchronisation, the expert gradients' rescale, the
exact normalisation by the global target count with clipping, and the optimizer step. The Trainer runs it (its
micro-step is Hugging Face's `training_step`, its optimizer step fires the callbacks and steps the scheduler) and
`shardtrain plan` traces the same code on fake tensors (its micro-step is the loss and its backward).

    runner = StepRunner(model=model, dims=dims, max_grad_norm=1.0, sharded=True)
    grad_norm, counts = runner.run(batches, micro_step, local_counts, step_samples, optimizer_step=step)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.expert import rescale_expert_grads
from shardtrain.train.step.optim import normalize_and_clip_grads


@dataclass(frozen=True, kw_only=True)
class StepRunner:
    """Runs optimizer steps of `model` on the layout `dims`.

    Attributes:
        model: the parallelised model.
        dims: the parallel sizes (the gradient average of FSDP, ep, tp, the world size).
        max_grad_norm: clip the gradient norm of the mean loss to this; <= 0: no clipping.
        sharded: FSDP holds the model (it averages gradients over its ranks; one reduce-scatter per step).
    """

    model: nn.Module
    dims: ParallelDims
    max_grad_norm: float
    sharded: bool

    def run(self, batches: list[Any], micro_step: Callable[[int, Any], None], local_counts: torch.Tensor,
            step_samples: int, *, optimizer_step: Callable[[], None],
            between: Callable[[], None] | None = None, mean_grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of every micro-batch, then the gradients of the step's mean loss, clipped, and
        `optimizer_step`.

        Args:
            batches: the step's micro-batches on this rank.
            micro_step: `(index, batch)`: forward and backward of one micro-batch, its loss *sum* divided by
                `step_samples` (a scale every rank knows without communication).
            local_counts: this rank's counts (target tokens first) of the whole step, float64 on the device.
            step_samples: the global batch in samples (the backward scale).
            optimizer_step: steps the optimizer and clears the gradients.
            between: called after each micro-batch but the last.
            mean_grads: the gradients already hold the step's mean loss (a library's loss, normalised by it).

        Returns:
            (gradient norm of the step's mean loss before clipping, the counts summed over the ranks).
        """
        last = len(batches) - 1
        for index, batch in enumerate(batches):
            if self.sharded and last > 0:  # reduce-scatter once per step, after the last micro-batch
                self.model.set_requires_gradient_sync(index == last)
            micro_step(index, batch)
            if index < last and between is not None:
                between()
        if self.dims.ep > 1:
            rescale_expert_grads(self.model)
        # FSDP averages gradients over its ranks (replicate x shard x cp); the ranks' token counts add up to the
        # global ones (a context-parallel rank counts the targets of its part of the sequences only)
        divisor = None if mean_grads else step_samples * (self.dims.grad_average_size if self.sharded else 1)
        grad_norm, counts = normalize_and_clip_grads(self.model.parameters(), local_counts, divisor,
                                                     self.max_grad_norm, self.dims.world_size,
                                                     count_copies=self.dims.tp)
        optimizer_step()
        return grad_norm, counts
