"""When the Trainer logs, evaluates and saves, what a log entry holds, and how the best checkpoint is tracked.
Part of `Trainer`.

The schedule is Hugging Face's own: `DefaultFlowCallback` (in `callback_handler`, as under transformers) turns the
strategies, intervals, `logging_first_step` and `eval_delay` into `control` flags at each step end and epoch end,
and the Trainer acts on the flags, as `transformers.Trainer._maybe_log_save_evaluate` does. Removing that callback
leaves only the flags other callbacks set, as under Hugging Face."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.manager import PREFIX
from shardtrain.train.logging import memory_kind, peak_memory_mb


def nan_inf_filtered(losses: list[float]) -> list[float]:
    """Hugging Face's `logging_nan_inf_filter`: the j-th step of a logging window whose loss is nan or inf counts
    as (sum of the window's earlier losses) / (j + 1), as `transformers.Trainer` accumulates it."""
    out: list[float] = []
    for loss in losses:
        out.append(loss if math.isfinite(loss) else sum(out) / (len(out) + 1))
    return out


class StepFlowMixin:
    """Logging, evaluation and saving after each step and epoch; callbacks."""

    def _maybe_log_evaluate_save(self, window: list, grad_norm: torch.Tensor) -> None:
        """Hugging Face's `_maybe_log_save_evaluate`: log (the losses of the steps in `window`), evaluate, save,
        as the `control` flags say (each event resets its flag)."""
        args, step = self.args, self.state.global_step
        if window and self.control.should_log:
            losses = self._fold_losses(window)
            logs = {"loss": sum(losses) / len(losses), "grad_norm": float(grad_norm),
                    "learning_rate": self._step_lr, **self._throughput_and_memory()}
            self.log(logs)
        metrics = None
        if self.control.should_evaluate:
            metrics = self.evaluate()
            self._report_to_hp_search(self._trial, step, metrics)  # Hugging Face's: a trial's intermediate value
            if args.save_strategy == "best":
                self.control.should_save = self._improves_best(metrics)
        if self.control.should_save:
            # the best checkpoint is the one about to be written (Hugging Face: _determine_best_metric first)
            self._update_best(metrics, str(Path(self._get_output_dir(self._trial)) / f"{PREFIX}{step}"))
            self._save_checkpoint(self.model, self._trial)
        elif metrics is not None:
            self._update_best(metrics)

    def _fold_losses(self, window: list) -> list[float]:
        """The step losses of `window` (each a global token sum / count: one all-reduce over the loss mesh), added
        to `train_loss`'s total; empties `window`. At the end of training the steps logged by no entry are folded in
        this way too, as Hugging Face's `train_loss` counts them."""
        sums = torch.stack([s for s, _ in window])
        self.backend.all_reduce(sums, group=self.meshes.loss.get_group())  # every token's loss once
        losses = [(s / max(t, 1)).item() for s, (_, t) in zip(sums, window, strict=True)]
        if self.args.logging_nan_inf_filter:
            losses = nan_inf_filtered(losses)
        self._loss_total, self._loss_steps = self._loss_total + sum(losses), self._loss_steps + len(losses)
        window.clear()
        return losses

    def _throughput_and_memory(self) -> dict[str, Any]:
        """Tokens/s since train() started, and every rank's peak memory (one small all-gather per log)."""
        mine = torch.tensor([peak_memory_mb()], dtype=torch.float64, device=self.device)
        per_rank = [round(float(t), 1) for t in self.backend.all_gather(mine)]
        return {"tokens_per_second": round(self.logger.tokens_per_second, 1), "peak_memory_mb": max(per_rank),
                "peak_memory_mb_per_rank": per_rank, "memory_kind": memory_kind()}

    def _metric_value(self, metrics: dict[str, float] | None) -> float | None:
        name = self.args.metric_for_best_model
        if not metrics or not name:
            return None
        return metrics.get(name, metrics.get(f"eval_{name}"))

    def _improves_best(self, metrics: dict[str, float] | None) -> bool:
        """Whether `metrics` beat `state.best_metric` on `metric_for_best_model`."""
        value, best = self._metric_value(metrics), self.state.best_metric
        if value is None:
            return False
        return best is None or (value > best if self.args.greater_is_better else value < best)

    def _update_best(self, metrics: dict[str, float] | None, checkpoint: str | None = None) -> None:
        if self._improves_best(metrics):
            self.state.best_metric = self._metric_value(metrics)
            self.state.best_global_step = self.state.global_step
            if checkpoint is not None:
                self.state.best_model_checkpoint = checkpoint

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

    def _draw_report(self) -> None:
        """output_dir/report.png from metrics.jsonl (rank 0, when matplotlib is installed)."""
        if self.rank != 0:
            return
        try:
            from shardtrain.train.report import draw_report

            draw_report(Path(self.args.output_dir) / "metrics.jsonl", Path(self.args.output_dir) / "report.png")
        except ImportError:
            return  # matplotlib is an extra: pip install 'shardtrain[report]'

    def _fire(self, event: str, **kwargs: Any) -> None:
        """Fire `event` through transformers' `CallbackHandler` (it passes the model, processing class, optimizer
        and scheduler, as in Hugging Face's Trainer); a returned control replaces ours."""
        handler = self.callback_handler
        handler.model, handler.processing_class = self.model, self.processing_class
        handler.optimizer, handler.lr_scheduler = self.optimizer, self.lr_scheduler
        # the handler's own method: it resets the flag the event answers (on_log: should_log, ...), as in transformers
        self.control = getattr(handler, event)(self.args, self.state, self.control, **kwargs)
