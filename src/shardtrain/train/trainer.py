"""`Trainer`: FSDP2 training, evaluation, checkpoints and export behind Hugging Face's Trainer API.

    trainer = Trainer(model, TrainingArguments(output_dir="out", fsdp="full_shard"), train_dataset=ds)
    result = trainer.train()   # TrainOutput(global_step, training_loss, metrics), as in transformers
    # under `shardtrain launch` / torchrun on N ranks, or as one plain process

The loss of a step is the sum over every target token of the global batch (all ranks, all micro-steps)
divided by the number of those tokens, so a run depends on the global batch only, not on its split.
Callbacks are transformers' (`TrainerCallback`, `TrainerState`, `TrainerControl`), fired at the same points.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_utils import TrainOutput, speed_metrics

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.config import env
from shardtrain.errors import install_error_hook
from shardtrain.parallel.backend import make_backend
from shardtrain.parallel.context import ContextParallel
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.expert import rescale_expert_grads
from shardtrain.train.arguments import TrainingArguments, TrainingArgumentsError
from shardtrain.train.chunked_loss import resolve_chunk_size
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
from shardtrain.train.logging import MetricsLogger
from shardtrain.train.lora import adapter_files
from shardtrain.train.loss import LossComputer, is_causal_lm
from shardtrain.train.model_setup import ModelSetupMixin
from shardtrain.train.optim import build_optimizer, build_scheduler, normalize_and_clip_grads
from shardtrain.train.preflight import PreflightMixin
from shardtrain.train.router_loss import RouterLoss
from shardtrain.train.state import CallbackHandler, TrainerCallback, TrainerControl, TrainerState
from shardtrain.train.step_flow import StepFlowMixin
from shardtrain.train.trainer_api import TrainerAPIMixin
from shardtrain.train.validation import DataError, OutputDirError, agree, writable_problem


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer(ModelSetupMixin, PreflightMixin, StepFlowMixin, TrainerAPIMixin):
    """Train, evaluate and save a model with FSDP2; the arguments are Hugging Face's (see module docstring).

    Args:
        model: an `nn.Module` (Hugging Face model or any module whose forward takes the batch keys), or the
            path of a pretrained directory (loaded on rank 0 only when `cpu_ram_efficient_loading`).
        args: `TrainingArguments` (default: output_dir "trainer_output").
        data_collator: batches a list of samples; default: `DataCollatorWithPadding` when `processing_class` is
            a tokenizer (as Hugging Face), else `PaddingCollator`.
        train_dataset / eval_dataset: map-style datasets of dicts (`datasets.Dataset` works).
        processing_class: the tokenizer/processor; its pad token is used and `save_model` saves it.
        model_init: builds the model when `model` is None.
        compute_loss_func: `fn(outputs, labels, num_items_in_batch) -> loss`, as in Hugging Face.
        compute_metrics: `fn(EvalPrediction) -> dict`, run over the whole eval set.
        callbacks: `transformers.TrainerCallback` instances or classes.
        optimizers: (optimizer, scheduler); an optimizer must be built on the parameters of the model as the
            Trainer holds it (after FSDP): prefer `optimizer_cls_and_kwargs`.
        optimizer_cls_and_kwargs: (optimizer class, kwargs), built on the sharded parameters with Hugging
            Face's weight-decay grouping.
        preprocess_logits_for_metrics: `fn(logits, labels) -> tensor` applied per batch before gathering.
        peft_config: a `peft` config (e.g. `LoraConfig`): adapters are added before FSDP and only they train
            (as TRL's trainers); a `PeftModel` passed as `model` works the same. See `shardtrain.train.lora`.
    """

    def __init__(self, model: nn.Module | str | None = None, args: TrainingArguments | None = None,
                 data_collator: Callable | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, model_init: Callable[[], nn.Module] | None = None,
                 compute_loss_func: Callable | None = None, compute_metrics: Callable | None = None,
                 callbacks: list[TrainerCallback] | None = None,
                 optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
                 optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
                 preprocess_logits_for_metrics: Callable | None = None, *, tokenizer: Any = None,
                 peft_config: Any = None) -> None:
        install_error_hook()
        self.args = args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        if args.use_cpu:  # the device choice is read from the launcher's variable (also by DataLoader workers)
            os.environ[env.CPU] = env.true_word(True)
        self.backend = make_backend(args)  # FSDP2, or PyTorch/XLA with fsdp_config "xla": true
        self.backend.setup()
        self.rank, self.world_size, self.device = self.backend.rank, self.backend.world_size, self.backend.device
        self.dims = ParallelDims.resolve(
            world_size=self.world_size, fsdp_config=args.fsdp_config if args.fsdp_enabled else None,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)),
            **{name.removesuffix("_size"): size for name, size in args.parallel_sizes.items()})
        self.meshes = self.dims.build(self.backend.host_device_type)
        self.backend.check(self, model)
        self.dp_rank = self.dims.rank_coords(self.rank)["batch"]  # which samples this rank sees
        self.cp = ContextParallel(self.meshes.cp, recompute=args.cp_regather_kv) if self.dims.cp > 1 else None
        agree(writable_problem(args.output_dir, "TrainingArguments.output_dir"), OutputDirError)
        set_seed(args.seed)
        if model is None:
            if model_init is None:
                raise TrainingArgumentsError("Trainer needs a model or a model_init function")
            model = model_init()
        self.model_init = model_init
        self.model = self._prepare_model(model, peft_config)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self._validate_samples = data_collator is None and not hasattr(self.processing_class, "pad")
        self.data_collator = data_collator or self._default_collator()
        self._keep_columns = forward_columns(self.model) if args.remove_unused_columns else None
        if self._keep_columns is not None:
            self.data_collator = ColumnFilter(self.data_collator, self._keep_columns)
        self._validated: set[int] = set()  # ids of datasets already checked by validate_dataset
        self.compute_metrics, self.compute_loss_func = compute_metrics, compute_loss_func
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.callback_handler = CallbackHandler(list(callbacks or []))
        self.state = TrainerState(is_local_process_zero=args.local_process_index == 0,
                                  is_world_process_zero=self.rank == 0)
        self.control = TrainerControl()
        chunk = resolve_chunk_size(args.loss_chunk_size, self.model, tensor_parallel=self.dims.tp > 1,
                                   device_type=self.device.type)
        self.loss = LossComputer(self.model, self.device, bf16_autocast=args.bf16 and not args.fsdp_enabled,
                                 chunk_size=chunk)
        self.router_loss = RouterLoss(self.model, self.meshes.loss.get_group())
        self._micro_batches = 1  # of the current optimizer step (training_step sets it)
        self.optimizer, self.lr_scheduler = optimizers
        self._check_given_optimizer()
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.logger = MetricsLogger(args, is_main=self.rank == 0)
        self._fire("on_init_end")

    @property
    def callbacks(self) -> list[TrainerCallback]:
        return self.callback_handler.callbacks

    # -- setup (the model's parallelism: shardtrain.train.model_setup) --------------------------------
    def _default_collator(self) -> Callable:
        if hasattr(self.processing_class, "pad"):  # a tokenizer: Hugging Face's default
            from transformers import DataCollatorWithPadding

            return DataCollatorWithPadding(self.processing_class)
        pad_id = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return PaddingCollator(pad_token_id=pad_id if pad_id is not None else 0,
                               labels_from_input_ids=is_causal_lm(self.model))

    def _check_given_optimizer(self) -> None:
        if self.optimizer is None:
            return
        held = {id(p) for p in self.model.parameters()}
        given = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if not given <= held:
            raise TrainingArgumentsError(
                "Trainer(optimizers=...) got an optimizer over parameters the Trainer does not train: FSDP "
                "replaces the model's parameters with sharded ones when the Trainer wraps it. Pass "
                "optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}) instead, or build the optimizer on "
                "trainer.model after creating the Trainer")

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model, self.args, self.optimizer_cls_and_kwargs)
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(self.optimizer, self.args, num_training_steps)

    def _checkpoints(self) -> CheckpointManager:
        """The Trainer's one `CheckpointManager` (it holds an async save in flight, its gloo group and buffers)."""
        manager = getattr(self, "_checkpoint_manager", None)
        if manager is None:
            manager = CheckpointManager(self.args.output_dir, model=self.model, optimizer=self.optimizer,
                                        scheduler=self.lr_scheduler,
                                        state_dict_type=self.args.fsdp_config.state_dict_type,
                                        save_total_limit=self.args.save_total_limit,
                                        frozen_base=self._frozen_base, extra_files=adapter_files(self.model),
                                        state_access=self.backend.state_access)
            self._checkpoint_manager = manager
        manager.model, manager.optimizer, manager.scheduler = self.model, self.optimizer, self.lr_scheduler
        return manager

    def _plan(self) -> BatchPlan:
        args = self.args
        # a process that feeds several devices (XLA SPMD) loads all their batches at once
        per_process = args.per_device_train_batch_size * self.backend.devices_per_process
        return BatchPlan(num_samples=len(self.train_dataset), per_device_batch_size=per_process,
                         accumulation_steps=args.gradient_accumulation_steps, dp_size=self.dims.batch_size,
                         dp_rank=self.dp_rank, seed=args.seed if args.data_seed is None else args.data_seed)

    def _loader(self, plan: BatchPlan, epoch: int, start_step: int) -> DataLoader:
        # Its own generator: creating the iterator must not draw from the global RNG that dropout uses, or a
        # resumed run (which creates one more iterator) would drop out different units.
        generator = torch.Generator().manual_seed(derive_seed(self.args.seed, "loader", epoch, self.dp_rank))
        workers = self.args.dataloader_num_workers
        return DataLoader(CollatingDataset(self.train_dataset, self.data_collator),
                          batch_sampler=StepBatchSampler(plan, epoch, start_step), collate_fn=passthrough,
                          num_workers=workers, generator=generator,
                          pin_memory=self.args.dataloader_pin_memory and self.device.type == "cuda",
                          prefetch_factor=self.args.dataloader_prefetch_factor if workers else None)

    # -- training -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Run the training loop; returns `TrainOutput(global_step, training_loss, metrics)`."""
        args = self.args
        self._validate_inputs()
        resume = self._resolve_resume(resume_from_checkpoint if resume_from_checkpoint is not None
                                      else args.resume_from_checkpoint)
        plan = self._plan()
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * plan.steps_per_epoch)
        self.create_optimizer_and_scheduler(max_steps)
        self.state = TrainerState(max_steps=max_steps, steps_per_epoch=plan.steps_per_epoch,
                                  global_batch_size=plan.global_batch_size, epoch=0.0,
                                  num_train_epochs=math.ceil(max_steps / plan.steps_per_epoch),
                                  train_batch_size=args.per_device_train_batch_size,
                                  logging_steps=args.interval("logging_steps", max_steps),
                                  eval_steps=args.interval("eval_steps", max_steps),
                                  save_steps=args.interval("save_steps", max_steps),
                                  is_local_process_zero=args.local_process_index == 0,
                                  is_world_process_zero=self.rank == 0, total_flos=0.0)
        if resume is not None:
            self._load_for_resume(resume, plan, max_steps)
        start_step, start_time = self.state.global_step, time.time()
        self._loss_total, self._loss_steps = 0.0, 0
        self.model.train()
        self.control.should_training_stop = False
        self._fire("on_train_begin")
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
        steps = self.state.global_step - start_step
        metrics = speed_metrics("train", start_time, num_samples=steps * plan.global_batch_size, num_steps=steps)
        training_loss = self._loss_total / max(self._loss_steps, 1)
        metrics.update(total_flos=self.state.total_flos, train_loss=training_loss, epoch=self.state.epoch)
        self.log(dict(metrics))
        self._draw_report()
        self._fire("on_train_end")
        return TrainOutput(self.state.global_step, training_loss, metrics)

    def _load_for_resume(self, resume: Path, plan: BatchPlan, max_steps: int) -> None:
        saved = CheckpointManager.read_state(resume)
        if saved.get("global_batch_size") != plan.global_batch_size:
            raise TrainingArgumentsError(
                f"{resume} was trained with a global batch of {saved.get('global_batch_size')} samples, this run "
                f"has {plan.global_batch_size}; keep per_device_train_batch_size x gradient_accumulation_steps x "
                "ranks equal to resume exactly")
        fresh = self.state
        self.state = TrainerState.from_dict(self._checkpoints().load(resume))
        self.state.max_steps = max_steps
        self.state.is_local_process_zero, self.state.is_world_process_zero = \
            fresh.is_local_process_zero, fresh.is_world_process_zero
        if self.rank == 0:
            self.logger.truncate_after(self.state.global_step)  # steps after it will be logged again

    def _train_loop(self, plan: BatchPlan, max_steps: int) -> None:
        window: list[tuple[torch.Tensor, int]] = []
        while self.state.global_step < max_steps and not self.control.should_training_stop:
            epoch, start = divmod(self.state.global_step, plan.steps_per_epoch)
            micro_batches = iter(self._loader(plan, epoch, start))
            self.control.should_epoch_stop = False
            self._fire("on_epoch_begin")
            for _ in range(start, plan.steps_per_epoch):
                self.control.should_log = self.control.should_evaluate = self.control.should_save = False
                self._fire("on_step_begin")
                batches = [next(micro_batches) for _ in range(self.args.gradient_accumulation_steps)]
                loss_sum, tokens, grad_norm = self.training_step(batches)
                self.state.global_step += 1
                self.state.epoch = self.state.global_step / plan.steps_per_epoch
                window.append((loss_sum, tokens))
                self.logger.step_done(self.state.num_input_tokens_seen)
                self._fire("on_step_end")
                self._maybe_log_evaluate_save(window, grad_norm)
                if self.state.global_step >= max_steps or self.control.should_training_stop or \
                        self.control.should_epoch_stop:
                    break
            self._fire("on_epoch_end")

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """Hugging Face's override point: the loss of `inputs`, summed over their target tokens and divided by
        `num_items_in_batch` (the target tokens of the whole global batch of this step).

        Overriding it (or passing `compute_loss_func`) costs one extra all-reduce per step: the global token
        count must be known before the forward. Return the loss in that convention (sum / num_items_in_batch)
        for the step to equal the default one.
        """
        if self.compute_loss_func is not None:
            labels = inputs["labels"]
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        else:
            # outputs asked for: with their logits (no chunked loss)
            loss_sum, outputs = self.loss.compute(inputs, keep_logits=return_outputs)
            count = num_items_in_batch if num_items_in_batch is not None else self.loss.items(inputs)
            loss = loss_sum / count
            if self.router_loss.enabled and model.training:  # MoE: + coef x load-balancing loss (router_loss.py),
                # this rank's share, averaged over the step's micro-batches (as the cross entropy is summed)
                loss = loss + self.router_loss.local_share(outputs, inputs) / self._micro_batches
        return (loss, outputs) if return_outputs else loss

    def training_step(self, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Forward/backward over the micro-batches of one optimizer step, then clip and step.

        Returns:
            (local sum of token losses, global number of target tokens, total grad norm); the global number
            of input tokens is added to `state.num_input_tokens_seen`.
        """
        batches = [self._model_inputs(b) for b in batches]
        # The backward pass needs a scale that is the same on every rank and known without communication:
        # 1 / (global batch in samples). The exact 1 / (global target tokens) is applied afterwards by
        # `normalize_and_clip_grads`, whose one all-reduce carries the token counts with the gradient norm.
        global_samples = max(self.state.global_batch_size, 1)
        fsdp = self.backend.is_sharded(self.model)
        custom = self._custom_loss
        num_items = None
        # Hugging Face's compute_loss contract, and the router loss (added in token-sum units), need the global
        # target-token count before the forward
        by_compute_loss = custom or self.router_loss.enabled
        if by_compute_loss:
            num_items = self.loss.local_counts(batches)[0].clone()
            self.backend.all_reduce(num_items, group=self.meshes.loss.get_group())  # tp ranks share their tokens
            num_items = num_items.to(torch.int64)
        self._micro_batches = len(batches)
        loss_sum = torch.zeros((), device=self.device)
        for index, batch in enumerate(batches):
            if fsdp and len(batches) > 1:  # reduce-scatter once per step, not per micro-step
                self.model.set_requires_gradient_sync(index == len(batches) - 1)
            if by_compute_loss:
                micro_sum = self.compute_loss(self.model, batch, num_items_in_batch=num_items) * num_items
            else:
                micro_sum = self.loss(batch)
            (micro_sum / global_samples).backward()
            loss_sum += micro_sum.detach().float()
            if index < len(batches) - 1:
                self._fire("on_substep_end")
        # FSDP averages gradients over its ranks (replicate x shard x cp). The token counts of the ranks add up to
        # the global ones: each context-parallel rank counts the targets of its part of the sequences only.
        divisor = global_samples * (self.dims.grad_average_size if fsdp else 1)
        if self.dims.ep > 1:
            rescale_expert_grads(self.model)
        grad_norm, counts = normalize_and_clip_grads(self.model.parameters(), self.loss.local_counts(batches),
                                                     divisor, self.args.max_grad_norm, self.world_size,
                                                     count_copies=self.dims.tp)
        tokens, input_tokens = (int(c) for c in counts.tolist())
        if tokens == 0:  # every rank knows the global count: all raise together, before a useless update
            raise DataError(f"the global batch of step {self.state.global_step + 1} has no target token (every "
                            "label is -100); make sure each batch has labels to learn from (longer samples, or "
                            "a larger batch)")
        self._fire("on_pre_optimizer_step")
        self.backend.optimizer_step(self.optimizer)
        self._fire("on_optimizer_step")
        self._step_lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step used (what Hugging Face logs)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.step_end()
        self.state.num_input_tokens_seen += input_tokens
        self.state.total_flos += 6.0 * self._flop_params() * input_tokens
        return loss_sum, tokens, grad_norm

    @property
    def _custom_loss(self) -> bool:
        return type(self).compute_loss is not Trainer.compute_loss or self.compute_loss_func is not None

    def _flop_params(self) -> int:
        """Non-embedding parameters, for Hugging Face's total_flos estimate (6 x parameters x tokens)."""
        if not hasattr(self, "_flop_param_count"):
            count = getattr(self.model, "num_parameters", None)
            self._flop_param_count = count(exclude_embeddings=True) if callable(count) else \
                sum(p.numel() for p in self.model.parameters())
        return self._flop_param_count
