"""When the Trainer logs, evaluates and saves, what a log entry holds, and how the best checkpoint is tracked.
Part of `Trainer`.

The schedule is Hugging Face's own: `DefaultFlowCallback` (in `callback_handler`, as under transformers) turns the
strategies, intervals, `logging_first_step` and `eval_delay` into `control` flags at each step end and epoch end,
and the Trainer acts on the flags, as `transformers.Trainer._maybe_log_save_evaluate` does. Removing that callback
leaves only the flags other callbacks set, as under Hugging Face."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.layout import PREFIX


def nan_inf_filtered(losses: list[float]) -> list[float]:
    """Hugging Face's `logging_nan_inf_filter`: the j-th step of a logging window whose loss is nan or inf counts
    as (sum of the window's earlier losses) / (j + 1), as `transformers.Trainer` accumulates it."""
    out: list[float] = []
    for loss in losses:
        out.append(loss if math.isfinite(loss) else sum(out) / (len(out) + 1))
    return out


@dataclass(frozen=True, kw_only=True)
class BestMetric:
    """Which evaluation is the best so far: `metric_for_best_model` (with or without its `eval_` prefix), higher
    or lower as `greater_is_better` says. A pure rule over metrics and `TrainerState`."""

    name: str | None
    greater_is_better: bool | None

    @classmethod
    def of(cls, args: Any) -> BestMetric:
        return cls(name=args.metric_for_best_model, greater_is_better=args.greater_is_better)

    def value(self, metrics: dict[str, float] | None) -> float | None:
        if not metrics or not self.name:
            return None
        return metrics.get(self.name, metrics.get(f"eval_{self.name}"))

    def improves(self, metrics: dict[str, float] | None, best: float | None) -> bool:
        """Whether `metrics` beat `best` (None: nothing yet)."""
        value = self.value(metrics)
        if value is None:
            return False
        return best is None or (value > best if self.greater_is_better else value < best)

    def record(self, state: Any, metrics: dict[str, float] | None, checkpoint: str | None = None) -> None:
        """Make `metrics` (of `state.global_step`, saved in `checkpoint` when given) the best, when they improve."""
        if self.improves(metrics, state.best_metric):
            state.best_metric = self.value(metrics)
            state.best_global_step = state.global_step
            if checkpoint is not None:
                state.best_model_checkpoint = checkpoint


class LossWindow:
    """The steps' losses since the last log entry (local token sums and global counts) and the run's `train_loss`.

    Each step's loss is the global token sum / count; the sums are all-reduced once per log entry, not per step.
    """

    def __init__(self, all_reduce: Callable[[torch.Tensor], None], nan_inf_filter: bool) -> None:
        self._all_reduce, self._nan_inf_filter = all_reduce, nan_inf_filter
        self._steps: list[tuple[torch.Tensor, int]] = []
        self._total, self._count = 0.0, 0

    def __bool__(self) -> bool:
        return bool(self._steps)

    def add(self, loss_sum: torch.Tensor, tokens: int) -> None:
        """One step: this rank's loss sum (a tensor, not synchronised) and the step's global target count."""
        self._steps.append((loss_sum, tokens))

    def fold(self) -> list[float]:
        """The window's step losses, added to `train_loss`; empties the window. At the end of training the steps
        no entry logged are folded in this way too, as Hugging Face's `train_loss` counts them."""
        sums = torch.stack([s for s, _ in self._steps])
        self._all_reduce(sums)  # every token's loss once
        losses = [(s / max(t, 1)).item() for s, (_, t) in zip(sums, self._steps, strict=True)]
        if self._nan_inf_filter:
            losses = nan_inf_filtered(losses)
        self._total, self._count = self._total + sum(losses), self._count + len(losses)
        self._steps.clear()
        return losses

    @property
    def training_loss(self) -> float:
        """The mean step loss of every step folded so far."""
        return self._total / max(self._count, 1)


class StepFlowMixin:
    """Logging, evaluation and saving after each step and epoch; callbacks."""

    def _maybe_log_evaluate_save(self, window: LossWindow, grad_norm: torch.Tensor) -> None:
        """Hugging Face's `_maybe_log_save_evaluate`: log (the losses of the steps in `window`), evaluate, save,
        as the `control` flags say (each event resets its flag)."""
        args, step, best = self.args, self.state.global_step, BestMetric.of(self.args)
        if window and self.control.should_log:
            losses = window.fold()
            logs = {"loss": sum(losses) / len(losses), "grad_norm": float(grad_norm), "learning_rate": self._step_lr,
                    **self.logger.throughput_and_memory(self.backend.all_gather, self.device)}
            self.log(logs)
        metrics = None
        if self.control.should_evaluate:
            metrics = self.evaluate()
            self._report_to_hp_search(self._trial, step, metrics)  # Hugging Face's: a trial's intermediate value
            if args.save_strategy == "best":
                self.control.should_save = best.improves(metrics, self.state.best_metric)
        if self.control.should_save:
            # the best checkpoint is the one about to be written (Hugging Face: _determine_best_metric first)
            best.record(self.state, metrics, str(Path(self._get_output_dir(self._trial)) / f"{PREFIX}{step}"))
            self._save_checkpoint(self.model, self._trial)
        elif metrics is not None:
            best.record(self.state, metrics)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Hugging Face's hook (same signature, so a library's override that calls super() works): write
        `checkpoint-<step>` of the Trainer's model, optimizer, scheduler, RNG and state."""
        args = self.args
        if args.save_async:  # waits for the previous async save; see shardtrain.checkpoint.async_save
            self._checkpoints().save_async(self.state.global_step, self.state, model_only=args.save_only_model)
        else:
            self._checkpoints().save(self.state.global_step, self.state, model_only=args.save_only_model)
        self._saved_step = self.state.global_step
        self._fire("on_save")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record `logs` for this step in `log_history`, metrics.jsonl, TensorBoard and the progress bar."""
        entry = {**logs, "epoch": round(self.state.epoch or 0.0, 4), "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.logger.log(entry)
        self._fire("on_log", logs=entry)

    def _fire(self, event: str, **kwargs: Any) -> None:
        """Fire `event` through transformers' `CallbackHandler` (it passes the model, processing class, optimizer
        and scheduler, as in Hugging Face's Trainer); a returned control replaces ours."""
        handler = self.callback_handler
        handler.model, handler.processing_class = self.model, self.processing_class
        handler.optimizer, handler.lr_scheduler = self.optimizer, self.lr_scheduler
        # the handler's own method: it resets the flag the event answers (on_log: should_log, ...), as in transformers
        self.control = getattr(handler, event)(self.args, self.state, self.control, **kwargs)
