"""What the Trainer checks and decides before its first step: which checkpoint to resume from (`resolve_resume`),
and whether the datasets and arguments can be trained on (`DatasetChecks`, `check_training_inputs`). Every rank
raises the same error, before anything changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.layout import PREFIX, SHARDED_DIR
from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.errors import CheckpointError, DataError, OutputDirError, TrainingArgumentsError
from shardtrain.parallel.collectives import agree
from shardtrain.parallel.runtime import Runtime
from shardtrain.train.args.trackers import tracker_problem
from shardtrain.train.data.streaming import is_stream
from shardtrain.train.data.validation import ModelLimits, validate_dataset, writable_problem


def check_output_dir(output_dir: str) -> None:
    """Collective: every rank raises `OutputDirError` when any rank cannot write `output_dir`."""
    agree(writable_problem(output_dir, "TrainingArguments.output_dir"), OutputDirError)


def check_model_source(model: Any, model_init: Any, optimizers: tuple[Any, Any]) -> None:
    """The Trainer's model comes from exactly one of `model` and `model_init`; a `model_init` model gets its
    optimizer built by the Trainer (a given one would belong to a model that `train()` replaces)."""
    if model_init is not None and model is not None:
        raise TrainingArgumentsError("Trainer got both a model and a model_init function; pass one of them "
                                     "(model_init builds a fresh model at every train(), as in transformers)")
    if model_init is not None and any(part is not None for part in optimizers):
        raise TrainingArgumentsError("Trainer(model_init=..., optimizers=...): the optimizer would belong to a "
                                     "model that train() replaces; pass optimizer_cls_and_kwargs, or override "
                                     "create_optimizer_and_scheduler")
    if model is None and model_init is None:
        raise TrainingArgumentsError("Trainer needs a model or a model_init function")


def resolve_resume(resume: str | bool | None, *, output_dir: str | Path, auto: bool, fsdp_enabled: bool,
                   runtime: Runtime) -> Path | None:
    """The checkpoint to resume from: a path, True (newest, required), "auto" (newest if any), or None.

    None means "auto" when `auto` is set: under a torchrun restart, so `--max_restarts` continues from the
    newest checkpoint without any logic in the script, and under replica groups, whose job's state is the
    output directory. Rank 0 chooses (skipping damaged checkpoints with a warning) and broadcasts its choice
    over `runtime`'s ranks, so every rank loads the same one.
    """
    if resume is None and auto:
        resume = "auto"
    if resume in (None, False):
        return None
    if resume is True or resume == "auto":
        chosen, warnings = CheckpointManager.resumable(output_dir) if runtime.rank == 0 else (None, [])
        step = torch.tensor([int(chosen.name[len(PREFIX):]) if chosen else -1], dtype=torch.int64,
                            device=runtime.device)  # (broadcasting a copy would leave the other ranks at -1)
        runtime.backend.broadcast(step, src=0)
        for line in warnings:
            print(f"warning: {line}", flush=True)
        if int(step.item()) >= 0:
            path = Path(output_dir) / f"{PREFIX}{int(step.item())}"
            if runtime.rank == 0:
                print(f"Resuming from {path}", flush=True)
            return path
        if resume == "auto":
            return None
        raise CheckpointError(f"No valid checkpoint found in output directory ({output_dir}): "
                              "resume_from_checkpoint=True needs a complete, undamaged checkpoint-<step> there; "
                              "use resume_from_checkpoint='auto' to start fresh when there is none, or pass a path")
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"Can't find a valid checkpoint at {resume}: resume_from_checkpoint={str(resume)!r} is "
                              "not a directory; pass a checkpoint-<step> directory, True, or 'auto'")
    # a sharded checkpoint stays an FSDP run's (the seeds' rule); full ones (model.safetensors) resume anywhere
    if not fsdp_enabled and (path / SHARDED_DIR).is_dir():
        raise CheckpointError(f"{path} is a sharded FSDP checkpoint (SHARDED_STATE_DICT) but FSDP is off; resume "
                              "with TrainingArguments(fsdp=True) (and the same fsdp_config), or turn it into a "
                              "full model with `shardtrain merge`")
    return path


def check_training_inputs(args: Any, *, train_dataset: Any, eval_dataset: Any, cp_size: int,
                          custom_loss: bool) -> None:
    """The datasets `train()` needs for `args`, the trackers' credentials, and a loss that context parallelism can
    split."""
    if train_dataset is None:
        raise DataError("Trainer.train() needs a train_dataset; pass Trainer(..., train_dataset=...)")
    if args.eval_strategy != "no" and eval_dataset is None:
        raise DataError(f"TrainingArguments.eval_strategy={args.eval_strategy!r} needs an eval_dataset; pass "
                        "Trainer(..., eval_dataset=...) or set eval_strategy='no'")
    if args.load_best_model_at_end and eval_dataset is None:
        raise DataError("TrainingArguments.load_best_model_at_end needs an eval_dataset to choose the best "
                        "checkpoint; pass Trainer(..., eval_dataset=...)")
    problem = tracker_problem(list(args.report_to or []))
    if problem is not None:
        raise TrainingArgumentsError(problem)
    if cp_size > 1 and custom_loss:
        raise TrainingArgumentsError(
            f"cp_size = {cp_size} with a custom compute_loss / compute_loss_func: under context parallelism "
            "each rank holds part of every sequence and gets labels already shifted (batch key 'shift_labels'), "
            "which a loss written for whole sequences would get wrong; use the default loss or cp_size 1")


def check_pipeline_inputs(args: Any, *, stages: int, custom_loss: bool, loss_kind: str, per_sample: bool) -> None:
    """What a pipeline (pp_size > 1) trains: the token cross entropy of a causal LM the engine computes on the last
    stage, from micro-batches that split into `pp_microbatches` microbatches."""
    from shardtrain.parallel.pipeline_settings import PipelineSettings, check_settings

    check_settings(PipelineSettings.of(args), pp=stages, per_device_batch=args.per_device_train_batch_size,
                   compiled=bool(args.torch_compile))
    if custom_loss or per_sample or loss_kind != "token":
        what = "a custom compute_loss / compute_loss_func" if custom_loss else \
            "a library's own loss" if per_sample else f"a model trained on its {loss_kind} loss"
        raise TrainingArgumentsError(
            f"pp_size = {stages} with {what}: a pipeline computes the token cross entropy on its last stage (causal "
            "and masked language models, token classifiers); use the default loss, or pp_size 1")
    if args.predict_with_generate:
        raise TrainingArgumentsError(f"pp_size = {stages} with predict_with_generate: generation under a pipeline "
                                     "is not implemented yet; set predict_with_generate False, or pp_size 1")


@dataclass(kw_only=True)
class DatasetChecks:
    """Each dataset checked before it is used (`validate_dataset`: collective, every rank raises together), and
    the columns `remove_unused_columns` drops named once (Hugging Face's log line).

    Attributes:
        rank, device: this process and where the check's agreement runs.
        check_samples: check each sample's fields (False when a collator of the user's or a tokenizer pads).
        keep_columns: the columns `remove_unused_columns` keeps, or None (all).
    """

    rank: int
    device: torch.device
    check_samples: bool
    keep_columns: frozenset[str] | None = None
    checked: set[int] = field(default_factory=set)  # ids of the datasets checked

    def check(self, dataset: Any, name: str, limits: ModelLimits, *, need_targets: bool, again: bool = False) -> None:
        """Raise `DataError` on every rank when `dataset` cannot be used; a dataset already checked is skipped
        unless `again` (train() checks its datasets at every call)."""
        if id(dataset) in self.checked and not again:
            return
        validate_dataset(dataset, name=name, limits=limits, check_samples=self.check_samples,
                         need_targets=need_targets, device=self.device)
        self.checked.add(id(dataset))

    def check_eval(self, dataset: Any, name: str, limits: ModelLimits) -> None:
        """`check` for evaluate()/predict(), which need a dataset (samples without targets are allowed)."""
        if dataset is None:
            raise DataError("evaluate()/predict() needs a dataset; pass Trainer(..., eval_dataset=...) or a dataset")
        self.check(dataset, name, limits, need_targets=False)

    def check_eval_sets(self, eval_dataset: Any, limits: ModelLimits) -> None:
        """`check` for the evaluation set(s) train() evaluates: each of a dict, none that is a stream (its samples
        are not indexable: it is read as it comes, as transformers accepts it)."""
        named = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
        for key, dataset in named:
            if not is_stream(dataset):
                self.check(dataset, "eval_dataset" if key is None else f"eval_dataset[{key!r}]", limits,
                           need_targets=False, again=True)

    def report_unused_columns(self, dataset: Any, which: str, model_name: str) -> None:
        """Say which columns `remove_unused_columns` drops. Rank 0 only, so it must never raise (a peer would wait
        for rank 0 in the next collective)."""
        if self.keep_columns is None or self.rank != 0:
            return
        try:
            names = getattr(dataset, "column_names", None)
            if names is None and len(dataset):
                first = dataset[0]
                names = list(first) if isinstance(first, dict) else []
        except Exception:  # noqa: BLE001 - only a log line; the dataset checks report real problems
            return
        dropped = sorted(set(names or []) - self.keep_columns)
        if dropped:
            print(f"The following columns in the {which} set don't have a corresponding argument in "
                  f"`{model_name}.forward` and have been ignored: {', '.join(dropped)}.", flush=True)
