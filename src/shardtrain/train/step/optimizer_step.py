"""One optimizer step of the Trainer: the global target count (which also carries every rank's preemption flag),
Hugging Face's `training_step` on each micro-batch, the exact normalisation and clipping (`StepRunner`), and the
optimizer and scheduler step with Hugging Face's callbacks around it.

    step = OptimizerStep(runtime=runtime, loss=loss_computer, runner=runner, preemption=preemption)
    result = step.run(batches, placeholders, step=global_step, step_samples=64, training_step=fn, loss_scale=1,
                      by_samples=False, optimizer=optimizer, scheduler=scheduler, fire=fire)

The loss of a step is the sum over every target token of the global batch (all ranks, all micro-steps) divided
by the number of those tokens, so a run depends on the global batch only, not on its split. A library's batches
that the engine cannot read (`library_batches`: GRPO's and RLOO's prompts, which their `_prepare_inputs` turn into
generations) carry the library's own loss, normalised as under Hugging Face: each rank's loss, its gradients
averaged over the ranks (by FSDP, as by DDP).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardtrain.errors import DataError
from shardtrain.parallel.runtime import Runtime
from shardtrain.train.step.loss import LossComputer
from shardtrain.train.step.optim import steps_on_metric
from shardtrain.train.step.preemption import Preempted, PreemptionHandler
from shardtrain.train.step.step_runner import StepRunner


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one optimizer step reports.

    Attributes:
        loss_sum: this rank's sum of token losses (not synchronised: `LossWindow` all-reduces once per log).
        tokens: the global batch's target tokens (samples, for a loss per sample).
        input_tokens: the global batch's input tokens.
        grad_norm: the gradient norm of the step's mean loss, before clipping.
        learning_rate: the rate this step used (what Hugging Face logs).
    """

    loss_sum: torch.Tensor
    tokens: int
    input_tokens: int
    grad_norm: torch.Tensor
    learning_rate: float


@dataclass(frozen=True, kw_only=True)
class OptimizerStep:
    """Runs the Trainer's optimizer steps (see module docstring).

    Attributes:
        runtime: the backend (collectives, the optimizer step), the layout and the device.
        loss: the model's `LossComputer` (counts targets; marks placeholder micro-batches).
        runner: the micro-batches, normalisation, clipping and optimizer step shared with `shardtrain plan`.
        preemption: SIGTERM's flag, agreed on by every rank before each step.
    """

    runtime: Runtime
    loss: LossComputer
    runner: StepRunner
    preemption: PreemptionHandler

    def run(self, batches: list[dict[str, Any]], placeholders: list[bool] | None, *, step: int, step_samples: int,
            training_step: Callable[[dict[str, Any], torch.Tensor], torch.Tensor], loss_scale: int,
            by_samples: bool, optimizer: torch.optim.Optimizer, scheduler: Any,
            fire: Callable[[str], None]) -> StepResult:
        """Forward and backward of each micro-batch (`training_step(batch, num_items_in_batch)`, which returns
        Hugging Face's loss: the micro-batch's share of the step loss times `loss_scale`; its backward is scaled
        by 1 / `step_samples`, the global batch in samples), then the optimizer step.

        Raises:
            Preempted: on every rank, when any rank received SIGTERM (before the step changes anything).
            DataError: on every rank, when the global batch has no target.
        """
        placeholders = placeholders or [False] * len(batches)
        library = library_batches(batches)
        # this rank's counts; a library's batches count one per rank (its loss is a mean over the ranks)
        local = torch.tensor([1.0, 0.0], dtype=torch.float64, device=self.runtime.device) if library else \
            self.loss.local_counts(batches, placeholders, by_samples)
        # Hugging Face's num_items_in_batch: the target tokens of the whole global batch, known before the forward
        num_items = self.global_items(local, step, counted=not library)
        loss_sum = torch.zeros((), device=self.runtime.device)
        learning_rate = 0.0

        def micro_step(index: int, batch: dict[str, Any]) -> None:
            nonlocal loss_sum
            self.loss.placeholder = placeholders[index]  # a model's own mean loss weighs 0 there
            try:
                loss = training_step(batch, num_items)
            finally:
                self.loss.placeholder = False
            loss_sum += loss.detach().float() * (num_items / loss_scale if num_items is not None else 1)

        def optimizer_step() -> None:
            nonlocal learning_rate
            fire("on_pre_optimizer_step")
            self.runtime.backend.optimizer_step(optimizer)
            fire("on_optimizer_step")
            if steps_on_metric(scheduler):  # it steps after each evaluation (the Trainer's), on the metric
                learning_rate = optimizer.param_groups[0]["lr"]
            else:
                learning_rate = scheduler.get_last_lr()[0]
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            self.runtime.backend.step_end()

        # The backward pass needs a scale that is the same on every rank: 1 / step_samples, applied by
        # training_step. The exact 1 / (global target tokens) is applied afterwards by the runner, whose one
        # all-reduce carries the gradient norm (and the input tokens, for the state).
        grad_norm, counts = self.runner.run(batches, micro_step, local, step_samples, optimizer_step=optimizer_step,
                                            between=lambda: fire("on_substep_end"), mean_grads=library)
        tokens, input_tokens = (int(c) for c in counts.tolist())
        return StepResult(loss_sum=loss_sum, tokens=tokens, input_tokens=input_tokens, grad_norm=grad_norm,
                          learning_rate=learning_rate)

    def global_items(self, local: torch.Tensor, step: int, counted: bool = True) -> torch.Tensor | None:
        """The global batch's target tokens (samples, for a loss per sample) from this rank's `local` counts, as
        int64 on the device, in one small all-reduce that also carries whether any rank was asked to stop (see
        `run`'s errors); None when the batches are a library's (`counted` False: nothing to count)."""
        device = self.runtime.device
        header = torch.stack([local[0],
                              torch.tensor(float(self.preemption.requested), dtype=torch.float64, device=device)])
        self.runtime.backend.all_reduce(header)  # every rank: tp ranks hold the same tokens, counted tp times
        counted, stop = header.tolist()  # one device sync for both
        if stop > 0:
            raise Preempted(step)
        if not counted:
            return None
        items = round(counted / self.runtime.dims.tp)
        if items == 0:  # every rank knows the global count: all raise together, before a useless update
            raise DataError(f"the global batch of step {step + 1} has no target token (every label is -100); make "
                            "sure each batch has labels to learn from (longer samples, or a larger batch)")
        return torch.tensor(items, dtype=torch.int64, device=device)


def library_batches(batches: list[Any]) -> bool:
    """Whether the micro-batches are a library's that the engine cannot read (not mappings of model inputs)."""
    return any(not isinstance(batch, Mapping) for batch in batches)
