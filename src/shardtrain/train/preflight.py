"""What the Trainer checks and decides before its first step: which checkpoint to resume from, and whether
the datasets and arguments can be trained on (every rank raises the same error, before anything changes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.manager import OPTIMIZER_DIR, PREFIX, SHARDED_DIR, CheckpointManager
from shardtrain.errors import CheckpointError, DataError, TrainingArgumentsError
from shardtrain.train.streaming import is_stream
from shardtrain.train.validation import ModelLimits, validate_dataset


class PreflightMixin:
    """Part of `Trainer`: resume resolution and input validation."""

    def _resolve_resume(self, resume: str | bool | None) -> Path | None:
        """The checkpoint to resume from: a path, True (newest, required), "auto" (newest if any), or None.

        None under a torchrun restart (`TORCHELASTIC_RESTART_COUNT` > 0) means "auto", so `--max_restarts`
        continues from the newest checkpoint without any logic in the script. Rank 0 chooses (skipping
        damaged checkpoints with a warning) and every rank loads the same one.
        """
        if resume is None and self.spec.restart_count > 0:
            resume = "auto"
        if resume in (None, False):
            return None
        if resume is True or resume == "auto":
            chosen, warnings = CheckpointManager.resumable(self.args.output_dir) if self.rank == 0 else (None, [])
            step = torch.tensor([int(chosen.name[len(PREFIX):]) if chosen else -1], dtype=torch.int64,
                                device=self.device)  # (broadcasting a copy would leave the other ranks at -1)
            self.backend.broadcast(step, src=0)
            for line in warnings:
                if self.rank == 0:
                    print(f"warning: {line}", flush=True)
            if int(step.item()) >= 0:
                path = Path(self.args.output_dir) / f"{PREFIX}{int(step.item())}"
                if self.rank == 0:
                    print(f"Resuming from {path}", flush=True)
                return path
            if resume == "auto":
                return None
            raise CheckpointError(f"resume_from_checkpoint=True but {self.args.output_dir} has no complete, "
                                  "undamaged checkpoint-<step>; use resume_from_checkpoint='auto' to start fresh "
                                  "when there is none, or pass a path")
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"resume_from_checkpoint={str(resume)!r} is not a directory; pass a "
                                  f"checkpoint-<step> directory, True, or 'auto'")
        if not self.args.fsdp_enabled and ((path / SHARDED_DIR).is_dir() or (path / OPTIMIZER_DIR).is_dir()):
            raise CheckpointError(f"{path} is an FSDP checkpoint but FSDP is off; resume with "
                                  "TrainingArguments(fsdp=True) (and the same fsdp_config)")
        return path

    def _report_unused_columns(self, dataset: Any, which: str) -> None:
        """Say once which columns `remove_unused_columns` drops (Hugging Face's log line). Rank 0 only, so it
        must never raise (a peer would wait for rank 0 in the next collective)."""
        if self._keep_columns is None or self.rank != 0:
            return
        try:
            names = getattr(dataset, "column_names", None)
            if names is None and len(dataset):
                first = dataset[0]
                names = list(first) if isinstance(first, dict) else []
        except Exception:  # noqa: BLE001 - only a log line; the dataset checks report real problems
            return
        dropped = sorted(set(names or []) - self._keep_columns)
        if dropped:
            print(f"The following columns in the {which} set don't have a corresponding argument in "
                  f"`{type(self.model).__name__}.forward` and have been ignored: {', '.join(dropped)}.", flush=True)

    def _validate_inputs(self) -> None:
        """Everything that can be checked before the first step (collective: every rank raises together)."""
        args = self.args
        if self.train_dataset is None:
            raise DataError("Trainer.train() needs a train_dataset; pass Trainer(..., train_dataset=...)")
        if args.eval_strategy != "no" and self.eval_dataset is None:
            raise DataError(f"TrainingArguments.eval_strategy={args.eval_strategy!r} needs an eval_dataset; pass "
                            "Trainer(..., eval_dataset=...) or set eval_strategy='no'")
        if args.load_best_model_at_end and self.eval_dataset is None:
            raise DataError("TrainingArguments.load_best_model_at_end needs an eval_dataset to choose the best "
                            "checkpoint; pass Trainer(..., eval_dataset=...)")
        if self.cp is not None and self._custom_loss:
            raise TrainingArgumentsError(
                f"cp_size = {self.dims.cp} with a custom compute_loss / compute_loss_func: under context parallelism "
                "each rank holds part of every sequence and gets labels already shifted (batch key 'shift_labels'), "
                "which a loss written for whole sequences would get wrong; use the default loss or cp_size 1")
        limits = ModelLimits.of(self.model, self.loss_computer.shift_labels)
        if not is_stream(self.train_dataset):  # a stream is checked as it is read (its samples are not indexable)
            validate_dataset(self.train_dataset, name="train_dataset", limits=limits,
                             check_samples=self._validate_samples, need_targets=True, device=self.device)
            self._report_unused_columns(self.train_dataset, "training")  # after: the dataset is known readable
            self._validated.add(id(self.train_dataset))
        if self.eval_dataset is not None and args.eval_strategy != "no":
            validate_dataset(self.eval_dataset, name="eval_dataset", limits=limits,
                             check_samples=self._validate_samples, need_targets=False, device=self.device)
            self._validated.add(id(self.eval_dataset))
