"""Resuming a run: the checkpoint's saved state read once, then model, optimizer, scheduler, RNG and the
Trainer's state restored in one call.

    resume = Resume.read(path)                        # None: a fresh run
    per_device = resume.per_device_batch(configured)  # auto_find_batch_size: the batch the run had come down to
    state = resume.restore(manager, fresh_state, plan, max_steps, args=args, rank=rank)

A checkpoint of the same global batch resumes exactly where it stopped (its data position included). One of
another global batch (or a transformers checkpoint, which holds no batch plan) goes on with this run's plan, as
transformers' Trainer goes on, with a warning that it no longer equals an uninterrupted run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.trainer_utils import compare_trainer_and_checkpoint_args

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.train.data.training_data import Plan
from shardtrain.train.state import TrainerState


@dataclass(frozen=True)
class Resume:
    """A checkpoint to resume from and the state saved in it (read once, checked against its manifest)."""

    path: Path
    saved: dict[str, Any]

    @classmethod
    def read(cls, path: Path | None) -> Resume | None:
        return None if path is None else cls(Path(path), CheckpointManager.read_state(path))

    def per_device_batch(self, configured: int) -> int:
        """The per-device batch `auto_find_batch_size` had come down to (when it divides the configured one)."""
        saved = self.saved.get("train_batch_size") or configured
        return saved if configured % saved == 0 else configured

    def restore(self, manager: CheckpointManager, fresh: TrainerState, plan: Plan, max_steps: int, *, args: Any,
                rank: int) -> TrainerState:
        """Load model, optimizer, scheduler and RNG through `manager`; returns the Trainer's state as saved (on
        this run's plan when the global batch changed), with this run's `max_steps` and process flags."""
        same_plan = self.saved.get("global_batch_size") == plan.global_batch_size
        if rank == 0:  # Hugging Face's warning on logging/eval/save steps and batch sizes that changed; not on a
            # per-device batch that changed with the ranks while the global batch stayed (an exact resume)
            compared = {**self.saved, "train_batch_size": args.per_device_train_batch_size * max(1, args.n_gpu)} \
                if same_plan else self.saved
            compare_trainer_and_checkpoint_args(args, TrainerState.from_dict(compared))
        if "global_batch_size" in self.saved and not same_plan and rank == 0:
            warnings.warn(f"{self.path} was trained with a global batch of {self.saved['global_batch_size']} "
                          f"samples, this run has {plan.global_batch_size}: it goes on from step "
                          f"{self.saved.get('global_step')} with the new batch, so it no longer equals an "
                          "uninterrupted run; keep per_device_train_batch_size x gradient_accumulation_steps x "
                          "ranks equal to resume exactly", stacklevel=3)
        loaded = dict(manager.load(self.path, state=self.saved))
        if not same_plan:  # this run's plan, the data position from the step
            step = loaded.get("global_step", 0)
            epoch, in_epoch = divmod(step, plan.steps_per_epoch) if plan.steps_per_epoch else (0, step)
            loaded.update(steps_per_epoch=plan.steps_per_epoch, global_batch_size=plan.global_batch_size,
                          data_epoch=epoch, data_step=in_epoch)
        state = TrainerState.from_dict(loaded)
        state.max_steps = max_steps
        state.is_local_process_zero, state.is_world_process_zero = \
            fresh.is_local_process_zero, fresh.is_world_process_zero
        return state
