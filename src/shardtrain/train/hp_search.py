"""`Trainer.hyperparameter_search` on several ranks: Hugging Face's optuna backend keeps the study on rank 0 and
hands the other ranks a `FixedTrial` (`transformers.integrations.run_hp_search_optuna`), so only rank 0 can
decide to prune a trial. Its decision is broadcast here, so every rank leaves the trial at the same step (under
Hugging Face's DDP the other ranks would train on alone and wait for rank 0 forever)."""

from __future__ import annotations

from typing import Any

import torch
import transformers


class PrunedElsewhere(Exception):
    """Rank 0's study pruned the current trial; a rank other than 0 leaves `train()` (which returns)."""


def report_to_hp_search(trainer: Any, trial: Any, step: int, metrics: dict[str, float]) -> None:
    """Hugging Face's `_report_to_hp_search` on `trainer` (a trial's intermediate objective to its study); on
    several ranks under optuna, run on every rank and rank 0's pruning agreed.

    Raises:
        optuna.TrialPruned: on rank 0, when its study prunes the trial (optuna's `study.optimize` catches it).
        PrunedElsewhere: on every other rank then, after the `on_train_end` callbacks (which rank 0 ran).
    """
    def report() -> None:
        transformers.Trainer._report_to_hp_search(trainer, trial, step, metrics)

    if trainer.world_size == 1 or trial is None or trainer.hp_search_backend != "optuna":
        return report()
    import optuna

    pruned: optuna.TrialPruned | None = None
    try:
        report()
    except optuna.TrialPruned as err:
        pruned = err
    runtime = trainer.runtime
    flag = torch.tensor([float(pruned is not None)], device=runtime.device)
    runtime.backend.broadcast(flag, src=0)
    if flag.item() == 0:
        return None
    if runtime.rank == 0:
        raise pruned if pruned is not None else optuna.TrialPruned()
    trainer.call_event("on_train_end")
    raise PrunedElsewhere()
