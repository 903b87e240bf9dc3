"""`Trainer`: FSDP2 training, evaluation, checkpoints and export behind Hugging Face's Trainer API.

    trainer = Trainer(model, TrainingArguments(output_dir="out", fsdp=True), train_dataset=ds)
    trainer.train()          # under `shardtrain launch` / torchrun on N ranks, or as one plain process

The loss of a step is the sum over every target token of the global batch (all ranks, all micro-steps)
divided by the number of those tokens, so a run depends on the global batch only, not on its split.
"""

from __future__ import annotations

import math
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from shardtrain.checkpoint.errors import CheckpointError
from shardtrain.checkpoint.full import write_full_checkpoint
from shardtrain.checkpoint.manager import PREFIX, CheckpointManager, full_model_state, model_config_dict
from shardtrain.config import env
from shardtrain.errors import install_error_hook
from shardtrain.parallel.distributed import current_device, init_distributed
from shardtrain.parallel.fsdp import apply_fsdp
from shardtrain.parallel.loading import load_pretrained
from shardtrain.train.arguments import TrainingArguments, TrainingArgumentsError
from shardtrain.train.data import (
    BatchPlan,
    CollatingDataset,
    ColumnFilter,
    PaddingCollator,
    StepBatchSampler,
    derive_seed,
    forward_columns,
    passthrough,
)
from shardtrain.train.evaluation import EvalLoop, PredictionOutput
from shardtrain.train.logging import MetricsLogger
from shardtrain.train.loss import LossComputer
from shardtrain.train.optim import build_optimizer, build_scheduler, normalize_and_clip_grads
from shardtrain.train.state import TrainerCallback, TrainerControl, TrainerState
from shardtrain.train.validation import (
    DataError,
    ModelLimits,
    OutputDirError,
    agree,
    validate_dataset,
    writable_problem,
)

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun in every worker; > 0 after a restart


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Train, evaluate and save a model with FSDP2 (see module docstring).

    Args:
        model: an `nn.Module` (Hugging Face model or any module whose forward takes the batch keys), or the
            path of a pretrained directory (loaded on rank 0 only when `cpu_ram_efficient_loading`).
        args: `TrainingArguments`.
        train_dataset / eval_dataset: map-style datasets of dicts with `input_ids` (and optionally `labels`,
            `attention_mask`); `datasets.Dataset` works.
        data_collator: batches a list of samples; default pads (`PaddingCollator`).
        compute_metrics: `fn(EvalPrediction) -> dict` run on rank 0 over the whole eval set.
        callbacks: `TrainerCallback` instances.
        preprocess_logits_for_metrics: `fn(logits, labels) -> tensor` applied per batch before gathering.
    """

    def __init__(self, model: nn.Module | str, args: TrainingArguments, train_dataset: Any = None,
                 eval_dataset: Any = None, data_collator: Callable | None = None,
                 compute_metrics: Callable | None = None, callbacks: list[TrainerCallback] | None = None,
                 preprocess_logits_for_metrics: Callable | None = None) -> None:
        install_error_hook()
        self.args = args
        if args.use_cpu:  # the device choice is read from the launcher's variable (also by DataLoader workers)
            os.environ[env.CPU] = env.true_word(True)
        init_distributed(timeout_s=args.ddp_timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = current_device()
        agree(writable_problem(args.output_dir, "TrainingArguments.output_dir"), OutputDirError)
        set_seed(args.seed)
        self.model = self._prepare_model(model)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        pad_id = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        self.data_collator = data_collator or PaddingCollator(pad_token_id=pad_id if pad_id is not None else 0)
        self._default_collator = data_collator is None
        self._keep_columns = forward_columns(self.model) if args.remove_unused_columns else None
        if self._keep_columns is not None:
            self.data_collator = ColumnFilter(self.data_collator, self._keep_columns)
        self._validated: set[int] = set()  # ids of datasets already checked by validate_dataset
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.callbacks = list(callbacks or [])
        self.state = TrainerState()
        self.control = TrainerControl()
        self.loss = LossComputer(self.model, self.device, bf16_autocast=args.bf16 and not args.fsdp_enabled)
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        self.logger = MetricsLogger(args, is_main=self.rank == 0)

    # -- setup ----------------------------------------------------------------------------------------
    def _prepare_model(self, model: nn.Module | str) -> nn.Module:
        args = self.args
        config = args.fsdp_config
        if isinstance(model, str | os.PathLike):
            return load_pretrained(model, config if args.fsdp_enabled else None,
                                   mixed_precision=args.mixed_precision, device=self.device)
        if args.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            kwargs = {"use_reentrant": False, **args.gradient_checkpointing_kwargs}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if args.fsdp_enabled:
            if not isinstance(model, FSDPModule):
                model.to(self.device)
                apply_fsdp(model, config, mixed_precision=args.mixed_precision)
            return model
        model.to(self.device)
        if self.world_size > 1:
            raise TrainingArgumentsError(
                f"Trainer runs on {self.world_size} ranks but fsdp is off; set TrainingArguments(fsdp=True) "
                "(FSDP2 with sharding_strategy 'no_shard' is plain data parallelism)")
        return model

    def create_optimizer_and_scheduler(self, total_steps: int) -> None:
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model, self.args)
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(self.optimizer, self.args, total_steps)

    def _checkpoints(self) -> CheckpointManager:
        """The Trainer's one `CheckpointManager` (it holds an async save in flight, its gloo group and buffers)."""
        manager = getattr(self, "_checkpoint_manager", None)
        if manager is None:
            manager = CheckpointManager(self.args.output_dir, model=self.model, optimizer=self.optimizer,
                                        scheduler=self.lr_scheduler,
                                        state_dict_type=self.args.fsdp_config.state_dict_type,
                                        save_total_limit=self.args.save_total_limit)
            self._checkpoint_manager = manager
        manager.model, manager.optimizer, manager.scheduler = self.model, self.optimizer, self.lr_scheduler
        return manager

    def _plan(self) -> BatchPlan:
        args = self.args
        return BatchPlan(num_samples=len(self.train_dataset), per_device_batch_size=args.per_device_train_batch_size,
                         accumulation_steps=args.gradient_accumulation_steps, world_size=self.world_size,
                         rank=self.rank, seed=args.seed if args.data_seed is None else args.data_seed)

    def _loader(self, plan: BatchPlan, epoch: int, start_step: int) -> DataLoader:
        # Its own generator: creating the iterator must not draw from the global RNG that dropout uses, or a
        # resumed run (which creates one more iterator) would drop out different units.
        generator = torch.Generator().manual_seed(derive_seed(self.args.seed, "loader", epoch, self.rank))
        workers = self.args.dataloader_num_workers
        return DataLoader(CollatingDataset(self.train_dataset, self.data_collator),
                          batch_sampler=StepBatchSampler(plan, epoch, start_step), collate_fn=passthrough,
                          num_workers=workers, generator=generator,
                          pin_memory=self.args.dataloader_pin_memory and self.device.type == "cuda",
                          prefetch_factor=self.args.dataloader_prefetch_factor if workers else None)

    def _resolve_resume(self, resume: str | bool | None) -> Path | None:
        """The checkpoint to resume from: a path, True (newest, required), "auto" (newest if any), or None.

        None under a torchrun restart (`TORCHELASTIC_RESTART_COUNT` > 0) means "auto", so `--max_restarts`
        continues from the newest checkpoint without any logic in the script. Rank 0 chooses (skipping
        damaged checkpoints with a warning) and every rank loads the same one.
        """
        if resume is None and int(os.environ.get(RESTART_COUNT_ENV, "0") or 0) > 0:
            resume = "auto"
        if resume in (None, False):
            return None
        if resume is True or resume == "auto":
            chosen, warnings = CheckpointManager.resumable(self.args.output_dir) if self.rank == 0 else (None, [])
            step = torch.tensor([int(chosen.name[len(PREFIX):]) if chosen else -1], dtype=torch.int64)
            dist.broadcast(step.to(self.device), src=0)
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
        if not self.args.fsdp_enabled and ((path / "sharded").is_dir() or (path / "optimizer").is_dir()):
            raise CheckpointError(f"{path} is an FSDP checkpoint but FSDP is off; resume with "
                                  "TrainingArguments(fsdp=True) (and the same fsdp_config)")
        return path

    def _report_unused_columns(self, dataset: Any, which: str) -> None:
        """Say once which columns `remove_unused_columns` drops (Hugging Face's log line)."""
        if self._keep_columns is None or self.rank != 0 or not hasattr(dataset, "__getitem__"):
            return
        names = getattr(dataset, "column_names", None)
        if names is None and hasattr(dataset, "__len__") and len(dataset):
            first = dataset[0]
            names = list(first) if isinstance(first, dict) else []
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
        limits = ModelLimits.of(self.model, self.loss.shift_labels)
        self._report_unused_columns(self.train_dataset, "training")
        validate_dataset(self.train_dataset, name="train_dataset", limits=limits,
                         check_samples=self._default_collator, need_targets=True, device=self.device)
        self._validated.add(id(self.train_dataset))
        if self.eval_dataset is not None and args.eval_strategy != "no":
            validate_dataset(self.eval_dataset, name="eval_dataset", limits=limits,
                             check_samples=self._default_collator, need_targets=False, device=self.device)
            self._validated.add(id(self.eval_dataset))

    # -- training -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainerState:
        """Run the training loop; returns the final `TrainerState` (with `log_history`)."""
        args = self.args
        self._validate_inputs()
        resume = self._resolve_resume(resume_from_checkpoint if resume_from_checkpoint is not None
                                      else args.resume_from_checkpoint)
        plan = self._plan()
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * plan.steps_per_epoch)
        self.create_optimizer_and_scheduler(max_steps)
        self.state = TrainerState(max_steps=max_steps, steps_per_epoch=plan.steps_per_epoch,
                                  global_batch_size=plan.global_batch_size)
        if resume is not None:
            saved = CheckpointManager.read_state(resume)
            if saved.get("global_batch_size") != plan.global_batch_size:
                raise CheckpointError(
                    f"{resume} was trained with a global batch of {saved.get('global_batch_size')} samples, this "
                    f"run has {plan.global_batch_size}; keep per_device_train_batch_size x "
                    f"gradient_accumulation_steps x ranks equal to resume exactly")
            self.state = TrainerState.from_dict(self._checkpoints().load(resume))
            self.state.max_steps = max_steps
            if self.rank == 0:
                self.logger.truncate_after(self.state.global_step)  # steps after it will be logged again
        self.model.train()
        self._callback("on_train_begin")
        self.logger.start(self.state.global_step, max_steps, self.state.num_input_tokens_seen)
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate()
        try:
            self._train_loop(plan, max_steps)
        except KeyboardInterrupt:
            if self.rank == 0:
                print(f"error: interrupted at step {self.state.global_step}; resume with "
                      f"resume_from_checkpoint='auto'", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        # An async save still in flight is committed (or its error raised on every rank) before train() returns.
        self._checkpoints().wait()
        self.logger.close()
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            self._checkpoints().load(self.state.best_model_checkpoint, weights_only=True)
        self._callback("on_train_end")
        return self.state

    def _train_loop(self, plan: BatchPlan, max_steps: int) -> None:
        window: list[tuple[torch.Tensor, int]] = []
        while self.state.global_step < max_steps and not self.control.should_training_stop:
            epoch, start = divmod(self.state.global_step, plan.steps_per_epoch)
            micro_batches = iter(self._loader(plan, epoch, start))
            for _ in range(start, plan.steps_per_epoch):
                batches = [next(micro_batches) for _ in range(self.args.gradient_accumulation_steps)]
                loss_sum, tokens, grad_norm = self.training_step(batches)
                self.state.global_step += 1
                self.state.epoch = self.state.global_step / plan.steps_per_epoch
                window.append((loss_sum, tokens))
                self.logger.step_done(self.state.num_input_tokens_seen)
                self._maybe_log_evaluate_save(window, grad_norm)
                self._callback("on_step_end")
                if self.state.global_step >= max_steps or self.control.should_training_stop:
                    break

    def training_step(self, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Forward/backward over the micro-batches of one optimizer step, then clip and step.

        Returns:
            (local sum of token losses, global number of target tokens, total grad norm); the global number
            of input tokens is added to `state.num_input_tokens_seen`.
        """
        batches = [{k: v.to(self.device) for k, v in b.items()} for b in batches]
        # The backward pass needs a scale that is the same on every rank and known without communication:
        # 1 / (global batch in samples). The exact 1 / (global target tokens) is applied afterwards by
        # `normalize_and_clip_grads`, whose one all-reduce carries the token counts with the gradient norm.
        global_samples = max(self.state.global_batch_size, 1)
        fsdp = isinstance(self.model, FSDPModule)
        loss_sum = torch.zeros((), device=self.device)
        for index, batch in enumerate(batches):
            if fsdp and len(batches) > 1:  # reduce-scatter once per step, not per micro-step
                self.model.set_requires_gradient_sync(index == len(batches) - 1)
            micro_sum = self.loss(batch)
            (micro_sum / global_samples).backward()
            loss_sum += micro_sum.detach().float()
        # FSDP averages gradients over the data-parallel ranks (all ranks of the default group).
        divisor = global_samples * (self.world_size if fsdp else 1)
        grad_norm, counts = normalize_and_clip_grads(self.model.parameters(), self.loss.local_counts(batches),
                                                     divisor, self.args.max_grad_norm, self.world_size)
        tokens, input_tokens = (int(c) for c in counts.tolist())
        if tokens == 0:  # every rank knows the global count: all raise together, before a useless update
            raise DataError(f"the global batch of step {self.state.global_step + 1} has no target token (every "
                            "label is -100); make sure each batch has labels to learn from (longer samples, or "
                            "a larger batch)")
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.num_input_tokens_seen += input_tokens
        return loss_sum, tokens, grad_norm

    def _maybe_log_evaluate_save(self, window: list, grad_norm: torch.Tensor) -> None:
        args, step, max_steps = self.args, self.state.global_step, self.state.max_steps
        at_epoch_end = step % self.state.steps_per_epoch == 0
        last = step >= max_steps
        if (args.logging_strategy == "steps" and step % args.interval("logging_steps", max_steps) == 0) or \
                (args.logging_strategy == "epoch" and at_epoch_end) or (args.logging_first_step and step == 1) or \
                (last and window) or self.control.should_log:
            sums = torch.stack([s for s, _ in window])
            dist.all_reduce(sums)
            losses = [(s / max(t, 1)).item() for s, (_, t) in zip(sums, window, strict=True)]
            logs = {"loss": sum(losses) / len(losses), "grad_norm": float(grad_norm),
                    "learning_rate": self.lr_scheduler.get_last_lr()[0]}
            window.clear()
            self.control.should_log = False
            self.log(logs)
        metrics = None
        if (args.eval_strategy == "steps" and step % args.interval("eval_steps", max_steps) == 0) or \
                (args.eval_strategy == "epoch" and at_epoch_end) or self.control.should_evaluate:
            metrics = self.evaluate()
            self.control.should_evaluate = False
        if (args.save_strategy == "steps" and step % args.interval("save_steps", max_steps) == 0) or \
                (args.save_strategy == "epoch" and at_epoch_end) or self.control.should_save or \
                (args.save_strategy == "best" and self._improves_best(metrics)):
            self._save_checkpoint(metrics)
            self.control.should_save = False

    def _improves_best(self, metrics: dict[str, float] | None) -> bool:
        """Whether `metrics` beat `state.best_metric` on `metric_for_best_model` (save_strategy 'best')."""
        name = self.args.metric_for_best_model
        if not metrics or not name:
            return False
        value = metrics.get(name, metrics.get(f"eval_{name}"))
        if value is None:
            return False
        best = self.state.best_metric
        return best is None or (value > best if self.args.greater_is_better else value < best)

    def _save_checkpoint(self, metrics: dict[str, float] | None) -> None:
        args = self.args
        path = str(Path(args.output_dir) / f"checkpoint-{self.state.global_step}")
        if metrics and args.metric_for_best_model:
            name = args.metric_for_best_model
            value = metrics.get(name, metrics.get(f"eval_{name}"))
            if value is not None:
                better = self.state.best_metric is None or (
                    value > self.state.best_metric if args.greater_is_better else value < self.state.best_metric)
                if better:
                    self.state.best_metric, self.state.best_model_checkpoint = value, path
        if args.save_async:  # waits for the previous async save; see shardtrain.checkpoint.async_save
            self._checkpoints().save_async(self.state.global_step, self.state, model_only=args.save_only_model)
        else:
            self._checkpoints().save(self.state.global_step, self.state, model_only=args.save_only_model)
        self._callback("on_save")

    def log(self, logs: dict[str, float]) -> None:
        """Record `logs` for this step in `log_history`, metrics.jsonl, TensorBoard and the progress bar."""
        entry = {**logs, "epoch": round(self.state.epoch, 4), "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.logger.log(entry)
        self._callback("on_log", logs=entry)

    def _callback(self, event: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self.args, self.state, self.control, model=self.model, **kwargs)

    # -- evaluation and export ------------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss averaged over every eval token on every rank, plus `compute_metrics`; logged."""
        output = self.predict(eval_dataset if eval_dataset is not None else self.eval_dataset, metric_key_prefix,
                              with_predictions=self.compute_metrics is not None and not self.args.prediction_loss_only)
        self.log(output.metrics)
        self._callback("on_evaluate", metrics=output.metrics)
        return output.metrics

    def predict(self, test_dataset: Any, metric_key_prefix: str = "test",
                with_predictions: bool = True) -> PredictionOutput:
        """Run the model over `test_dataset` on all ranks; predictions and labels come back on every rank."""
        if test_dataset is None:
            raise DataError("evaluate()/predict() needs a dataset; pass Trainer(..., eval_dataset=...) or a dataset")
        if id(test_dataset) not in self._validated:
            validate_dataset(test_dataset, name=f"{metric_key_prefix}_dataset",
                             limits=ModelLimits.of(self.model, self.loss.shift_labels),
                             check_samples=self._default_collator, need_targets=False, device=self.device)
            self._validated.add(id(test_dataset))
        loop = EvalLoop(self.model, self.loss, self.data_collator, self.args.per_device_eval_batch_size,
                        self.rank, self.world_size, self.device, self.preprocess_logits_for_metrics,
                        seed=self.args.seed)
        return loop.run(test_dataset, metric_key_prefix, self.compute_metrics, with_predictions)

    def save_model(self, output_dir: str | None = None) -> Path:
        """Write the full model (config.json + safetensors) that `from_pretrained` loads; every rank calls it.

        The directory is checked before the model is gathered, and a failed write (disk full, permissions)
        raises the same `OutputDirError` on every rank.
        """
        out = Path(output_dir or self.args.output_dir)
        agree(writable_problem(out, "save_model directory") if self.rank == 0 else None, OutputDirError)
        state = full_model_state(self.model)
        problem = None
        if self.rank == 0:
            try:
                write_full_checkpoint(state, out, model_config_dict(self.model))
            except OSError as err:
                problem = f"could not write the model to {out}: {err}; free space or choose another directory"
        agree(problem, OutputDirError)
        return out
