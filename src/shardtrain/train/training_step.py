"""One optimizer step: Hugging Face's `compute_loss`, `training_step`, `prediction_step` and `_prepare_inputs`
with their signatures, and the step around them (the global target count, gradient normalisation, clipping).
Part of `Trainer`.

The loss of a step is the sum over every target token of the global batch (all ranks, all micro-steps)
divided by the number of those tokens, so a run depends on the global batch only, not on its split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtrain.errors import DataError
from shardtrain.train.preemption import Preempted
from shardtrain.train.step_runner import StepRunner


class TrainingStepMixin:
    """The step and Hugging Face's per-batch override points."""

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """Hugging Face's override point: the loss of `inputs`, summed over their target tokens (or samples, for
        a model trained on its own loss) and divided by `num_items_in_batch` (those of the whole global batch of
        this step; in evaluation, of `inputs`).

        An override (or `compute_loss_func`) must return the loss in that convention (sum / num_items_in_batch)
        for N ranks and gradient accumulation to equal one process; one returning a mean over `inputs` is exact
        on one process without accumulation only. Under evaluation, Hugging Face's rule applies: the mean of
        the batches' losses, weighted by their samples.
        """
        if self.compute_loss_func is not None:
            labels = inputs["labels"]
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        else:
            # outputs asked for: with their logits (no chunked loss)
            loss_sum, outputs = self.loss_computer.compute(inputs, keep_logits=return_outputs)
            count = num_items_in_batch if num_items_in_batch is not None else self.loss_computer.items(inputs)
            loss = loss_sum / count
            if self.router_loss.enabled and model.training:  # MoE: + coef x load-balancing loss (router_loss.py),
                # this rank's share, averaged over the step's micro-batches (as the cross entropy is summed)
                loss = loss + self.router_loss.local_share(outputs, inputs) / self._micro_batches
        if num_items_in_batch is not None:
            loss = loss * self._loss_scale  # Hugging Face's convention (see _loss_scale)
        return (loss, outputs) if return_outputs else loss

    def _optimizer_step(self, batches: list[dict[str, torch.Tensor]],
                        placeholders: list[bool] | None = None) -> tuple[torch.Tensor, int, torch.Tensor]:
        """One optimizer step: `training_step` (forward and backward) on each micro-batch, then clip and step.

        Returns:
            (local sum of token losses, global number of target tokens, total grad norm); the global number
            of input tokens is added to `state.num_input_tokens_seen`.
        """
        batches = [self._model_inputs(b) for b in batches]
        # The backward pass needs a scale that is the same on every rank and known without communication:
        # 1 / (global batch in samples). The exact 1 / (global target tokens) is applied afterwards by
        # `normalize_and_clip_grads`, whose one all-reduce carries the token counts with the gradient norm.
        self._step_samples = max(self.state.global_batch_size, 1)
        # Hugging Face's num_items_in_batch: the target tokens of the whole global batch, known before the
        # forward (one small all-reduce, which also tells every rank whether one of them was asked to stop)
        placeholders = placeholders or [False] * len(batches)
        by_samples = self._loss_per_sample
        num_items = self._global_items(batches, placeholders, by_samples)
        self._micro_batches = len(batches)
        loss_sum = torch.zeros((), device=self.device)

        def micro_step(index: int, batch: dict[str, torch.Tensor]) -> None:
            nonlocal loss_sum
            self.loss_computer.placeholder = placeholders[index]  # a model's own mean loss weighs 0 there
            try:
                loss = self.training_step(self.model, batch, num_items)
            finally:
                self.loss_computer.placeholder = False
            loss_sum += loss.detach().float() * num_items / self._loss_scale

        grad_norm, counts = self._step_runner.run(
            batches, micro_step, self.loss_computer.local_counts(batches, placeholders, by_samples),
            self._step_samples, optimizer_step=self._step_optimizer, between=lambda: self._fire("on_substep_end"))
        tokens, input_tokens = (int(c) for c in counts.tolist())
        self.state.num_input_tokens_seen += input_tokens
        self.state.total_flos += 6.0 * self._flop_params() * input_tokens
        return loss_sum, tokens, grad_norm

    @property
    def _step_runner(self) -> StepRunner:
        runner = getattr(self, "_runner", None)
        if runner is None:
            runner = self._runner = StepRunner(model=self.model, dims=self.dims, max_grad_norm=self.args.max_grad_norm,
                                               sharded=self.backend.is_sharded(self.model))
        return runner

    def _step_optimizer(self) -> None:
        """The optimizer step with Hugging Face's callbacks around it, the scheduler's step and the backend's end."""
        self._fire("on_pre_optimizer_step")
        self.backend.optimizer_step(self.optimizer)
        self._fire("on_optimizer_step")
        self._step_lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step used (what Hugging Face logs)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.step_end()

    def _global_items(self, batches: list[dict[str, torch.Tensor]], placeholders: list[bool],
                      by_samples: bool = False) -> torch.Tensor:
        """The global batch's target tokens (samples: `by_samples`) as int64 on the device; raises `Preempted` on
        every rank when any rank received SIGTERM, and `DataError` when the global batch has nothing to learn from."""
        header = torch.stack([self.loss_computer.local_counts(batches, placeholders, by_samples)[0],
                              torch.tensor(float(self.preemption.requested), dtype=torch.float64,
                                           device=self.device)])
        self.backend.all_reduce(header)  # every rank: tp ranks hold the same tokens, counted tp times
        counted, stop = header.tolist()  # one device sync for both
        if stop > 0:
            raise Preempted(self.state.global_step)
        items = round(counted / self.dims.tp)
        if items == 0:  # every rank knows the global count: all raise together, before a useless update
            raise DataError(f"the global batch of step {self.state.global_step + 1} has no target token (every "
                            "label is -100); make sure each batch has labels to learn from (longer samples, or "
                            "a larger batch)")
        return torch.tensor(items, dtype=torch.int64, device=self.device)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor | None, Any, Any]:
        """Hugging Face's override point: (loss, logits, labels) of one evaluation batch; the loss is the mean
        over the batch (from `compute_loss`), None without labels. When it (or `compute_loss`) is overridden,
        evaluation calls it once per batch and averages the losses over samples, as Hugging Face does; otherwise
        evaluation sums token losses exactly over every rank."""
        inputs = self._prepare_inputs(inputs)
        has_labels = all(inputs.get(name) is not None for name in self.label_names)
        ignore = set(ignore_keys or []) | {"loss"}
        with torch.no_grad():
            if has_labels:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach().mean()
                if isinstance(outputs, dict):
                    logits = outputs.get("logits") if "logits" not in ignore else None
                    if logits is None:
                        logits = next((v for k, v in outputs.items() if k not in ignore), None)
                else:
                    logits = outputs[1] if isinstance(outputs, tuple | list) and len(outputs) > 1 else None
            else:
                loss, logits = None, self.loss_computer.logits(inputs)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, inputs.get("labels") if has_labels else None

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face's hook: the batch as the model gets it (on the device); called by `training_step` and
        `prediction_step`. The Trainer's own batches arrive prepared (and split under context parallelism)."""
        if all(not isinstance(v, torch.Tensor) or v.device == self.device for v in inputs.values()):
            return inputs
        return self.backend.to_device(inputs)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Hugging Face's override point: forward and backward of one micro-batch.

        Returns:
            the micro-batch's loss, detached: the sum of its token losses / `num_items_in_batch` (the target
            tokens of the global batch), so the micro-batches of every rank add up to the step's loss.
        """
        model.train()
        inputs = self._prepare_inputs(inputs)
        every = self.args.torch_empty_cache_steps
        if every and self.state.global_step % every == 0 and torch.cuda.is_available():
            torch.cuda.empty_cache()  # as Hugging Face: lower peak reserved memory, at a speed cost
        by_samples = self._loss_per_sample
        if num_items_in_batch is None:  # called on its own: this micro-batch's tokens (or samples)
            num_items_in_batch = self.loss_computer.items(inputs, by_samples=by_samples)
        if by_samples:  # a mean over this micro-batch, weighted by its samples (placeholders: 0)
            loss = self.compute_loss(model, inputs)
            micro_sum = loss * self.loss_computer.items(inputs, by_samples=True)
        elif self._custom_loss or self.router_loss.enabled:
            # Hugging Face's compute_loss contract (and the router loss, added in token-sum units)
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            micro_sum = loss * num_items_in_batch / self._loss_scale
        else:
            micro_sum = self.loss_computer(inputs)
        if self.loss_computer.placeholder:  # stands in for no sample: forward and backward (FSDP collectives), weight 0
            micro_sum = micro_sum * 0.0
        (micro_sum / getattr(self, "_step_samples", 1)).backward()
        # Hugging Face's return: this micro-batch's share of the step loss, times _loss_scale
        return micro_sum.detach() / num_items_in_batch * self._loss_scale

    @property
    def _custom_loss(self) -> bool:
        return type(self).compute_loss is not TrainingStepMixin.compute_loss or self.compute_loss_func is not None
