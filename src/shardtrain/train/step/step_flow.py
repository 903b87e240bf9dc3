"""What a training log entry holds (`LossWindow`: the steps' losses since the last entry, and `train_loss`) and
which evaluation is the best (`BestMetric`): pure rules the Trainer applies after each step.

When it logs, evaluates and saves is Hugging Face's own schedule: `DefaultFlowCallback` (in `callback_handler`, as
under transformers) turns the strategies, intervals, `logging_first_step` and `eval_delay` into `control` flags at
each step end and epoch end, and the Trainer acts on the flags (`TrainerLoopHooks.log_evaluate_save`, as
`transformers.Trainer._maybe_log_save_evaluate`). Removing that callback leaves only the flags other callbacks set,
as under Hugging Face."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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

    def __init__(self, all_reduce: Callable[..., None], *, group: Any = None, nan_inf_filter: bool) -> None:
        self._all_reduce, self._group, self._nan_inf_filter = all_reduce, group, nan_inf_filter
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
        self._all_reduce(sums, group=self._group)  # every token's loss once (the loss mesh's ranks)
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
