"""`Trainer.hyperparameter_search` on several ranks: Hugging Face's optuna backend keeps the study on rank 0 and
hands the other ranks a `FixedTrial` (`transformers.integrations.run_hp_search_optuna`), so only rank 0 can
decide to prune a trial. Its decision is broadcast here, so every rank leaves the trial at the same step (under
Hugging Face's DDP the other ranks would train on alone and wait for rank 0 forever)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardtrain.parallel.runtime import Runtime


class PrunedElsewhere(Exception):
    """Rank 0's study pruned the current trial; a rank other than 0 leaves `train()` (which returns)."""


def report_agreed(report: Callable[[], None], *, runtime: Runtime, on_pruned: Callable[[], None]) -> None:
    """Run Hugging Face's `_report_to_hp_search` (`report`) on every rank and agree on rank 0's pruning.

    Raises:
        optuna.TrialPruned: on rank 0, when its study prunes the trial (optuna's `study.optimize` catches it).
        PrunedElsewhere: on every other rank then, after `on_pruned` (the `on_train_end` callbacks rank 0 ran).
    """
    import optuna

    pruned: optuna.TrialPruned | None = None
    try:
        report()
    except optuna.TrialPruned as err:
        pruned = err
    flag = torch.tensor([float(pruned is not None)], device=runtime.device)
    runtime.backend.broadcast(flag, src=0)
    if flag.item() == 0:
        return
    if runtime.rank == 0:
        raise pruned if pruned is not None else optuna.TrialPruned()
    on_pruned()
    raise PrunedElsewhere()
