"""One optimizer step, in one place: the global counts (one small all-reduce, which also carries every rank's
preemption flag), each micro-batch's forward and backward, the gradient synchronisation, the expert gradients'
rescale, clipping (one all-reduce of the squared norm) and the optimizer step. Whoever runs a step hands in its
`StepHooks`: the Trainer's run Hugging Face's `training_step` and callbacks, the planner's (`shardtrain plan`) the
loss and its backward on fake tensors.

    step = OptimizerStep(model=model, dims=dims, device=device, all_reduce=backend.all_reduce, max_grad_norm=1.0,
                         sharded=True, loss=loss_computer, preemption=preemption)
    result = step.run(batches, placeholders, hooks, step=global_step, by_samples=False)

The loss of a step is the sum over every target token of the global batch (all ranks, all micro-steps) divided
by the number of those tokens, so a run depends on the global batch only, not on its split. The counts are known
before the first forward, so each micro-batch's backward is scaled once, by `grad_scale` (FSDP's average over its
ranks compensated): the gradients are then the mean loss's, and clipping is all that is left. A library's
batches that the engine cannot read (`library_batches`: GRPO's and RLOO's prompts, which their `_prepare_inputs`
turn into generations) carry the library's own loss, normalised as under Hugging Face: each rank's loss, its
gradients averaged over the ranks (by FSDP, as by DDP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardtrain.errors import DataError
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.expert import rescale_expert_grads
from shardtrain.parallel.pipeline import Pipeline
from shardtrain.train.step.guard import StepGuard
from shardtrain.train.step.loss import LossComputer
from shardtrain.train.step.micro import MicroStep
from shardtrain.train.step.optim import clip_grads
from shardtrain.train.step.preemption import Preempted, PreemptionHandler

if TYPE_CHECKING:
    from shardtrain.parallel.replicas import ReplicaGroups


class StepHooks(Protocol):
    """What a step calls back into."""

    def micro_step(self, micro: MicroStep) -> torch.Tensor:
        """Forward and backward of one micro-batch, the backward of its loss *sum* times `micro.grad_scale`;
        returns that sum, detached (for the logged loss)."""

    def between_micro_steps(self) -> None:
        """After each micro-batch but the last."""

    def optimizer_step(self) -> float:
        """Step the optimizer (and scheduler) and clear the gradients; the learning rate the step used."""

    def discard_step(self) -> float:
        """The step guard skipped the step: clear the gradients, step nothing; the learning rate it had."""


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one optimizer step reports.

    Attributes:
        loss_sum: this rank's sum of token losses (not synchronised: `LossWindow` all-reduces once per log).
        tokens: the global batch's target tokens (samples, for a loss per sample).
        input_tokens: the global batch's input tokens.
        grad_norm: the gradient norm of the step's mean loss, before clipping.
        learning_rate: the rate this step used (what Hugging Face logs).
        skipped: why the step guard skipped the step (nothing was updated), or None.
        committed: False when the replica groups did not commit the step (nothing was updated; its batches are
            read again for the next quorum).
        groups: the replica groups whose samples the step trained (empty: no replica groups).
    """

    loss_sum: torch.Tensor
    tokens: int
    input_tokens: int
    grad_norm: torch.Tensor
    learning_rate: float
    skipped: str | None = None
    committed: bool = True
    groups: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class OptimizerStep:
    """Runs optimizer steps of `model` on the layout `dims` (see the module's docstring).

    Attributes:
        model: the parallelised model.
        dims: the parallel sizes (FSDP's gradient average, ep, tp, the world size).
        device: where counts and norms are reduced.
        all_reduce: sums a tensor over every rank, in place (the backend's).
        max_grad_norm: clip the gradient norm of the mean loss to this; <= 0: no clipping.
        sharded: FSDP holds the model (it averages gradients over its ranks; one reduce-scatter per step).
        loss: the model's `LossComputer` (counts targets; marks placeholder micro-batches).
        preemption: SIGTERM's flag, agreed on by every rank before each step (None: not watched).
        guard: the step guard (None: every step is applied); its loss travels in clipping's all-reduce.
        pipeline: this rank's pipeline stage (None: no pipeline): its schedule reduces the gradients, its tied
            embeddings' gradients are summed over the first and last stage before clipping.
        replicas: the replica groups (None: none): counts and gradients summed over the quorum, the step applied
            only if it commits.
    """

    model: nn.Module
    dims: ParallelDims
    device: torch.device
    all_reduce: Callable[[torch.Tensor], None]
    max_grad_norm: float
    sharded: bool
    loss: LossComputer
    preemption: PreemptionHandler | None = None
    guard: StepGuard | None = None
    pipeline: Pipeline | None = None
    replicas: ReplicaGroups | None = None

    def run(self, batches: list[Any], placeholders: list[bool] | None, hooks: StepHooks, *, step: int,
            by_samples: bool, counts: tuple[int, int] | None = None) -> StepResult:
        """Forward and backward of each micro-batch, then clipping and the optimizer step.

        `counts`: the global (target, input) counts when they are known without reading the batches (the
        planner's fake tensors cannot be read); None: counted and all-reduced.

        Raises:
            Preempted: on every rank, when any rank received SIGTERM (before the step changes anything).
            DataError: on every rank, when the global batch has no target.
        """
        placeholders = placeholders or [False] * len(batches)
        library = library_batches(batches)
        if counts is None:
            # this rank's counts; a library's batches count one per rank (its loss is a mean over the ranks)
            local = torch.tensor([1.0, 0.0], dtype=torch.float64, device=self.device) if library else \
                self.loss.local_counts(batches, placeholders, by_samples)
            counts = self.global_counts(local, step, counted=not library)
        if self.replicas is not None:
            counts = self.replicas.reduce_counts(*counts)
            if counts is None:  # a peer died: the step cannot commit (every group's state stays as it was)
                return self._uncommitted(hooks)
        targets, inputs = counts
        # Hugging Face's num_items_in_batch: the target tokens of the whole global batch, known before the forward
        num_items = None if library else torch.tensor(targets, dtype=torch.int64, device=self.device)
        average = self.dims.grad_average_size if self.sharded else 1
        grad_scale = 1.0 if library else average / targets
        loss_sum = torch.zeros((), device=self.device)
        last = len(batches) - 1
        # a pipeline's micro-batches share one shape (its stages infer their activations' shapes before the first)
        shape = self.pipeline.step_shape(batches) if self.pipeline is not None else contextlib.nullcontext()
        with shape:
            for index, batch in enumerate(batches):
                if self.sharded and last > 0 and self.pipeline is None:  # reduce-scatter once, after the last one
                    self.model.set_requires_gradient_sync(index == last)
                micro = MicroStep(batch=batch, index=index, count=len(batches), num_items=num_items,
                                  grad_scale=grad_scale, placeholder=placeholders[index])
                with self.loss.running(micro):  # for code with Hugging Face's signatures (a placeholder weighs 0)
                    loss_sum += hooks.micro_step(micro)
                if index < last:
                    hooks.between_micro_steps()
        if self.dims.ep > 1:
            rescale_expert_grads(self.model)
        if self.replicas is not None:  # the quorum's sum (and the logged loss's), then all commit or none
            self.replicas.reduce_grads(list(self.model.parameters()), [loss_sum])
            if not self.replicas.commit():
                return self._uncommitted(hooks, closed=True, loss_sum=loss_sum, tokens=targets, inputs=inputs)
        uncounted: set[int] = set()
        if self.pipeline is not None:
            self.pipeline.sum_tied_grads()
            uncounted = self.pipeline.uncounted()
        carry = loss_sum.detach().to(torch.float64).reshape(1).clone() if self.guard is not None else None
        grad_norm = clip_grads(self.model.parameters(), self.max_grad_norm, self.dims.world_size, self.device,
                               carry=carry, stage_size=self.dims.stage_size, uncounted=uncounted)
        skipped = None
        if self.guard is not None:  # the global mean loss (tp ranks hold the same sum) and norm: one decision
            loss = float(carry.item()) / self.dims.tp / targets
            skipped = self.guard.judge(loss, float(grad_norm))
            if skipped is None:
                self.guard.kept(loss)
        learning_rate = hooks.optimizer_step() if skipped is None else hooks.discard_step()
        return StepResult(loss_sum=loss_sum, tokens=targets, input_tokens=inputs, grad_norm=grad_norm,
                          learning_rate=learning_rate, skipped=skipped,
                          groups=self.replicas.groups if self.replicas is not None else ())

    def _uncommitted(self, hooks: StepHooks, *, closed: bool = False, loss_sum: torch.Tensor | None = None,
                     tokens: int = 0, inputs: int = 0) -> StepResult:
        """The result of a step the replica groups did not commit: nothing stepped, the gradients dropped.
        `closed`: the quorum has voted already; else this rank votes no first (every rank of the group reports the
        failure, so the quorum closes)."""
        if not closed:
            self.replicas.commit()
        hooks.discard_step()
        zero = torch.zeros((), device=self.device)
        return StepResult(loss_sum=zero if loss_sum is None else loss_sum, tokens=tokens, input_tokens=inputs,
                          grad_norm=zero, learning_rate=0.0, committed=False)

    def global_counts(self, local: torch.Tensor, step: int, counted: bool = True) -> tuple[int, int]:
        """(target tokens or samples, input tokens) of the global batch from this rank's `local` counts, in one
        small all-reduce that also carries whether any rank was asked to stop (see `run`'s errors)."""
        stop = float(self.preemption.requested) if self.preemption is not None else 0.0
        header = torch.cat([local.to(torch.float64), torch.tensor([stop], dtype=torch.float64, device=self.device)])
        self.all_reduce(header)
        *counts, stop = header.tolist()  # one device sync for all
        if stop > 0:
            raise Preempted(step)
        # tp ranks and pipeline stages hold the same tokens
        targets, inputs = (round(c / self.dims.data_copies) for c in counts)
        if counted and targets == 0:  # every rank knows the global count: all raise together, before an update
            raise DataError(f"the global batch of step {step + 1} has no target token (every label is -100); make "
                            "sure each batch has labels to learn from (longer samples, or a larger batch)")
        return targets, inputs


def library_batches(batches: list[Any]) -> bool:
    """Whether the micro-batches are a library's that the engine cannot read (not mappings of model inputs)."""
    return any(not isinstance(batch, Mapping) for batch in batches)
