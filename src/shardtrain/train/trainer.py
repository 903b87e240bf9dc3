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
import transformers
from torch import nn
from transformers.integrations.neftune import activate_neftune, deactivate_neftune
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback
from transformers.trainer_utils import TrainOutput, speed_metrics

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.config import env
from shardtrain.config.run_spec import RunSpec
from shardtrain.errors import DataError, OutputDirError, TrainingArgumentsError, install_error_hook
from shardtrain.parallel.runtime import Runtime
from shardtrain.train.argument_checks import check_compute_metrics
from shardtrain.train.arguments import TrainingArguments
from shardtrain.train.chunked_loss import resolve_chunk_size
from shardtrain.train.collation import Collators
from shardtrain.train.data import (
    BatchPlan,
)
from shardtrain.train.hf_internals import HFInternalsMixin
from shardtrain.train.hp_search import PrunedElsewhere
from shardtrain.train.logging import JsonPrinterCallback, JsonProgressCallback, MetricsLogger, rank0_trackers
from shardtrain.train.lora import adapter_files
from shardtrain.train.loss import LossComputer
from shardtrain.train.model_preparation import SIDE_MODELS, ModelPreparation
from shardtrain.train.optimizer_setup import OptimizerSetupMixin
from shardtrain.train.packing import check_packing
from shardtrain.train.preemption import EXIT_CODE, Preempted, PreemptionHandler
from shardtrain.train.preflight import DatasetChecks, check_training_inputs, resolve_resume
from shardtrain.train.router_loss import RouterLoss
from shardtrain.train.state import TrainerCallback, TrainerControl, TrainerState
from shardtrain.train.step_flow import LossWindow, StepFlowMixin
from shardtrain.train.streaming import StreamPlan, check_stream_arguments, is_stream
from shardtrain.train.trainer_api import TrainerAPIMixin
from shardtrain.train.training_data import TrainingData
from shardtrain.train.training_step import TrainingStepMixin
from shardtrain.train.user_loader import LoaderPlan
from shardtrain.train.validation import ModelLimits, agree, writable_problem


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer(HFInternalsMixin, OptimizerSetupMixin, TrainingStepMixin, StepFlowMixin, TrainerAPIMixin,
              transformers.Trainer):
    """A `transformers.Trainer` whose job runs on shardtrain's FSDP2 engine (see module docstring).

    The constructor is Hugging Face's (same arguments, same attributes); it does not build Accelerate's
    `Accelerator`: the backend sets up the process group, the meshes and the model's parallelism. Hugging
    Face's override points are called where Hugging Face calls them, with its signatures: `compute_loss`,
    `training_step` (one micro-batch: forward and backward), `prediction_step`, `create_optimizer`,
    `create_scheduler`, `get_decay_parameter_names`, `log`, `get_train_dataloader`/`get_eval_dataloader`,
    `_prepare_inputs`.

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
        compute_metrics: `fn(EvalPrediction) -> dict`, run over the whole eval set (`batch_eval_metrics`:
            `fn(EvalPrediction, compute_result)` after every batch, as Hugging Face).
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
        # the run description (arguments, launcher environment, parallel sizes), resolved once, and the runtime
        # started from it: backend (FSDP2, or PyTorch/XLA with fsdp_config "xla": true), meshes, cp, device
        self.spec = spec = RunSpec.resolve(args)
        self.runtime = runtime = Runtime.start(spec, model)
        self.backend, self.dims, self.meshes, self.cp = runtime.backend, runtime.dims, runtime.meshes, runtime.cp
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.dp_rank = runtime.dp_rank  # which samples this rank sees
        self.preparation = ModelPreparation(runtime)
        agree(writable_problem(args.output_dir, "TrainingArguments.output_dir"), OutputDirError)
        set_seed(args.seed)
        self.model_init, self._peft_config = model_init, peft_config
        if model_init is not None and model is not None:
            raise TrainingArgumentsError("Trainer got both a model and a model_init function; pass one of them "
                                         "(model_init builds a fresh model at every train(), as in transformers)")
        if model_init is not None and any(part is not None for part in optimizers):
            raise TrainingArgumentsError("Trainer(model_init=..., optimizers=...): the optimizer would belong to a "
                                         "model that train() replaces; pass optimizer_cls_and_kwargs, or override "
                                         "create_optimizer_and_scheduler")
        if model is None:
            if model_init is None:
                raise TrainingArgumentsError("Trainer needs a model or a model_init function")
            model = self.call_model_init()
        self._install_model(model)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class if processing_class is not None else tokenizer
        if args.pack_sequences:
            check_packing(self.model, data_collator, use_cache=args.use_cache)
        # Hugging Face's remove_unused_columns: the columns `_set_signature_columns_if_needed` names (a library's
        # override, e.g. TRL's, keeps the ones its collator needs)
        self._signature_columns: list[str] | None = None
        keep_columns = None
        # a library that builds its own dataloaders (sentence-transformers) keeps the columns its collator reads
        owns_loading = not self.labels_from_inputs and self._overrides_train_loader
        if args.remove_unused_columns and not owns_loading:
            self._set_signature_columns_if_needed()
            keep_columns = frozenset(self._signature_columns)
        collators = Collators.build(model=self.model, processing_class=self.processing_class,
                                    data_collator=data_collator, pack=args.pack_sequences,
                                    context_parallel=self.cp is not None, keep_columns=keep_columns)
        self.data_collator, self._unpacked_collator = collators.train, collators.unpacked
        # samples are checked field by field unless a collator of the user's (or a tokenizer) pads them
        self.dataset_checks = DatasetChecks(rank=self.rank, device=self.device, keep_columns=keep_columns,
                                            check_samples=data_collator is None and
                                            not hasattr(self.processing_class, "pad"))
        self.compute_metrics, self.compute_loss_func = compute_metrics, compute_loss_func
        check_compute_metrics(args, compute_metrics)
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        # Hugging Face's default callbacks: DefaultFlowCallback, and the display (a progress bar or a printer)
        self.callback_handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])], self.model,
                                                self.processing_class, self.optimizer, self.lr_scheduler)
        self.add_callback(JsonPrinterCallback if args.disable_tqdm else JsonProgressCallback)
        for tracker in rank0_trackers(args.report_to, self.rank):
            self.add_callback(tracker)
        self.state = TrainerState(is_local_process_zero=args.local_process_index == 0,
                                  is_world_process_zero=self.rank == 0)
        self.control = TrainerControl()
        self._micro_batches = 1  # of the current optimizer step (training_step sets it)
        self._check_given_optimizer()
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.logger = MetricsLogger(spec.output_dir, is_main=self.rank == 0)
        self.preemption = PreemptionHandler()
        self._saved_step: int | None = None  # the step of the newest checkpoint this run wrote
        self._set_hf_attributes()
        self._fire("on_init_end")

    def _install_model(self, model: nn.Module | str) -> None:
        """Prepare `model` (adapters, parallelism, weights) and build what is bound to it: the loss, the router
        loss; the step runner and checkpoint manager follow it. `__init__` calls it, and `train()` with each
        model `model_init` builds."""
        args = self.args
        self.model, self._frozen_base = self.preparation.prepare(model, self._peft_config)
        self.model_wrapped = self.model
        chunk = resolve_chunk_size(args.loss_chunk_size, self.model, tensor_parallel=self.dims.tp > 1,
                                   device_type=self.device.type)
        self.loss_computer = LossComputer(self.model, self.device,
                                          bf16_autocast=args.bf16 and not args.fsdp_enabled, chunk_size=chunk,
                                          label_smoothing=args.label_smoothing_factor)
        if args.label_smoothing_factor and self.loss_computer.kind == "model":
            raise TrainingArgumentsError(
                f"TrainingArguments.label_smoothing_factor = {args.label_smoothing_factor} with "
                f"{type(self.model).__name__}, which is trained on its own loss (not a cross entropy shardtrain "
                "computes); set label_smoothing_factor 0, or smooth the labels in the model's loss")
        self.router_loss = RouterLoss(self.model, self.meshes.loss.get_group())
        self.__dict__.pop("_flop_param_count", None)
        if getattr(self.model, "config", None) is not None:  # as Hugging Face: no KV cache unless asked for (a
            self.model.config.use_cache = args.use_cache  # cache also turns off packed-sequence masks)

    def _reinit_model(self, trial: Any) -> None:
        """Hugging Face's model re-init at the start of `train()` when the Trainer has a `model_init`: the seed,
        then a fresh model (given the trial under `hyperparameter_search`), a fresh optimizer and scheduler."""
        manager = self.__dict__.pop("_checkpoint_manager", None)
        if manager is not None:  # an async save of the previous model finishes first
            manager.close()
        self.model = self.model_wrapped = None  # the previous model's memory is free before the next is built
        set_seed(self.args.seed)
        self._install_model(self.call_model_init(trial))
        self.optimizer, self.lr_scheduler = None, None

    # -- setup (the model's layout: shardtrain.train.model_preparation) --------------------------------
    # a causal LM batch without labels learns every token; a library's trainer (shardtrain.on_engine) gets its
    # collator's batches as they are, as under Hugging Face
    labels_from_inputs = True

    def _model_inputs(self, batch: dict[str, torch.Tensor], add_labels: bool = True) -> dict[str, Any]:
        """A collated batch as the model gets it (`ModelPreparation.inputs`): labels made from the inputs unless
        `add_labels` is False or the Trainer is a library's."""
        return self.preparation.inputs(batch, self.loss_computer, with_labels=add_labels and self.labels_from_inputs)

    def _parallelize_side_models(self) -> None:
        """A library's frozen extra models (TRL's `ref_model`, `teacher_model`, ...) sharded like the trained one,
        so that no rank holds a full copy while training."""
        for name in SIDE_MODELS:
            side = getattr(self, name, None)
            if isinstance(side, nn.Module) and side is not self.model:
                setattr(self, name, self.preparation.prepare_frozen(side))

    def _eval_collator(self) -> Callable:
        """The collator of evaluation and prediction batches (padded even when training packs them)."""
        return self._unpacked_collator if self._unpacked_collator is not None else self.data_collator

    def _checkpoints(self) -> CheckpointManager:
        """The Trainer's one `CheckpointManager` (it holds an async save in flight, its gloo group and buffers)."""
        manager = getattr(self, "_checkpoint_manager", None)
        # Hugging Face's run directory: output_dir, or output_dir/run-<trial> under hyperparameter_search
        root = Path(self._get_output_dir(getattr(self, "_trial", None)))
        if manager is not None and manager.output_dir != root:
            manager.close()
            manager = None
        if manager is None:
            manager = CheckpointManager(root, model=self.model, optimizer=self.optimizer,
                                        scheduler=self.lr_scheduler,
                                        state_dict_type=self.args.fsdp_config.state_dict_type,
                                        save_total_limit=self.args.save_total_limit,
                                        frozen_base=self._frozen_base, extra_files=adapter_files(self.model),
                                        state_access=self.backend.state_access)
            self._checkpoint_manager = manager
        manager.model, manager.optimizer, manager.scheduler = self.model, self.optimizer, self.lr_scheduler
        return manager

    @property
    def _overrides_train_loader(self) -> bool:
        """Whether a subclass (a user's, or a library's) overrides `get_train_dataloader`."""
        return type(self).get_train_dataloader is not TrainerAPIMixin.get_train_dataloader

    def _training_data(self) -> TrainingData:
        """The training batches' part, from the dataset and collator the Trainer holds now."""
        return TrainingData.of(self.args, self.runtime, self.train_dataset, self.data_collator)

    def _plan(self, data: TrainingData) -> BatchPlan | StreamPlan | LoaderPlan:
        if not self._overrides_train_loader:
            return data.plan()
        owner = next(c.__qualname__ for c in type(self).__mro__ if "get_train_dataloader" in vars(c))
        return data.plan(self.get_train_dataloader, owner)

    # -- training -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Run the training loop; returns `TrainOutput(global_step, training_loss, metrics)`."""
        args = self.args
        if self.model_init is not None:
            self._reinit_model(trial)
        self._hp_search_setup(trial)  # Hugging Face's: a trial's hyperparameters into args (and self._trial)
        self._runner = None  # the step runner reads this run's max_grad_norm
        self._validate_inputs()
        resume = resolve_resume(resume_from_checkpoint if resume_from_checkpoint is not None
                                else args.resume_from_checkpoint, output_dir=args.output_dir,
                                restart_count=self.spec.restart_count, fsdp_enabled=args.fsdp_enabled,
                                rank=self.rank, broadcast=lambda t: self.backend.broadcast(t, src=0),
                                device=self.device)
        data = self._training_data()
        plan = self._plan(data)
        if isinstance(plan, StreamPlan):
            check_stream_arguments(args)
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * plan.steps_per_epoch)
        self.create_optimizer_and_scheduler(max_steps)
        self.state = TrainerState(max_steps=max_steps, steps_per_epoch=plan.steps_per_epoch,
                                  global_batch_size=plan.global_batch_size, epoch=0.0,
                                  num_train_epochs=math.ceil(max_steps / (plan.steps_per_epoch or max_steps)),
                                  train_batch_size=args.per_device_train_batch_size,
                                  logging_steps=args.interval("logging_steps", max_steps),
                                  eval_steps=args.interval("eval_steps", max_steps),
                                  save_steps=args.interval("save_steps", max_steps),
                                  is_local_process_zero=args.local_process_index == 0,
                                  is_world_process_zero=self.rank == 0, total_flos=0.0)
        if resume is not None:
            self._load_for_resume(resume, plan, max_steps)
        start_step, start_time = self.state.global_step, time.time()
        window = LossWindow(lambda t: self.backend.all_reduce(t, group=self.meshes.loss.get_group()),
                            nan_inf_filter=args.logging_nan_inf_filter)
        self.model.train()
        self.control.should_training_stop = False
        self._fire("on_train_begin")
        self.logger.start(self.state.global_step, max_steps, self.state.num_input_tokens_seen)
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate()
        self.is_in_train = True
        self.preemption.install()
        neftune = activate_neftune(self.model, self.neftune_noise_alpha) if self.neftune_noise_alpha else None
        try:
            self._train_loop(data, plan, max_steps, window)
        except KeyboardInterrupt:
            if self.rank == 0:
                print(f"error: interrupted at step {self.state.global_step}; resume with "
                      f"resume_from_checkpoint='auto'", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except Preempted as preempted:
            self._checkpoint_and_exit(preempted)
        except PrunedElsewhere:  # rank 0's study pruned this trial (hp_search.py); rank 0 raised optuna's error
            return TrainOutput(self.state.global_step, window.training_loss, {})
        finally:
            if neftune is not None:
                deactivate_neftune(self.model, neftune)
            self.preemption.uninstall()
            self.is_in_train = False
        # An async save still in flight is committed (or its error raised on every rank) before train() returns.
        self._checkpoints().wait()
        self.logger.close()
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            self._checkpoints().load(self.state.best_model_checkpoint, weights_only=True)
        self._checkpoints().keep_best_only(self.state.best_model_checkpoint)
        steps = self.state.global_step - start_step
        metrics = speed_metrics("train", start_time, num_samples=steps * plan.global_batch_size, num_steps=steps)
        training_loss = window.training_loss
        metrics.update(total_flos=self.state.total_flos, train_loss=training_loss, epoch=self.state.epoch)
        self.log(dict(metrics))
        self.logger.draw_report()
        self._fire("on_train_end")
        return TrainOutput(self.state.global_step, training_loss, metrics)

    def _validate_inputs(self) -> None:
        """Everything that can be checked before the first step (collective: every rank raises together)."""
        check_training_inputs(self.args, train_dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                              cp_size=self.dims.cp, custom_loss=self._custom_loss)
        limits, checks = ModelLimits.of(self.model, self.loss_computer.shift_labels), self.dataset_checks
        if not is_stream(self.train_dataset):  # a stream is checked as it is read (its samples are not indexable)
            checks.check(self.train_dataset, "train_dataset", limits, need_targets=True, again=True)
            checks.report_unused_columns(self.train_dataset, "training", type(self.model).__name__)
        if self.eval_dataset is not None and self.args.eval_strategy != "no":
            checks.check(self.eval_dataset, "eval_dataset", limits, need_targets=False, again=True)

    def _checkpoint_and_exit(self, preempted: Preempted) -> None:
        """SIGTERM: a complete checkpoint of the last finished step (unless one was just written), then 143."""
        if self._saved_step != self.state.global_step:
            self._save_checkpoint(self.model, self._trial)
        self._checkpoints().wait()
        if self.rank == 0:
            print(f"warning: {preempted}; wrote {self.args.output_dir}/checkpoint-{self.state.global_step}, exiting "
                  f"{EXIT_CODE}; a restart resumes from it", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE) from None

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
        self._saved_step = self.state.global_step  # its checkpoint exists
        if self.rank == 0:
            self.logger.truncate_after(self.state.global_step)  # steps after it will be logged again

    def _train_loop(self, data: TrainingData, plan: BatchPlan | StreamPlan | LoaderPlan, max_steps: int,
                    window: LossWindow) -> None:
        grad_norm = torch.zeros(())
        while self.state.global_step < max_steps and not self.control.should_training_stop:
            # where the data stands: derived from the step (map-style), or saved with it (a stream)
            epoch, start = (self.state.data_epoch, self.state.data_step) if isinstance(plan, StreamPlan) else \
                divmod(self.state.global_step, plan.steps_per_epoch)
            self.control.should_epoch_stop = False
            self._fire("on_epoch_begin")
            steps = data.epoch_steps(plan, epoch, start)
            for step, (batches, placeholders) in enumerate(steps, start):
                self._fire("on_step_begin")
                loss_sum, tokens, grad_norm = self._optimizer_step(batches, placeholders)
                self.state.global_step += 1
                self.state.data_epoch, self.state.data_step = epoch, step + 1
                self.state.epoch = self.state.global_step / plan.steps_per_epoch if plan.steps_per_epoch else \
                    float(epoch)  # a stream: the passes completed
                window.add(loss_sum, tokens)
                self.logger.step_done(self.state.num_input_tokens_seen)
                self._fire("on_step_end")
                self._maybe_log_evaluate_save(window, grad_norm)
                if self.state.global_step >= max_steps or self.control.should_training_stop or \
                        self.control.should_epoch_stop:
                    break
            else:  # the pass is over
                if isinstance(plan, StreamPlan) and self.state.data_step == 0 and start == 0:
                    raise DataError("train_dataset (a stream) gave no sample; check that iterating it yields samples")
                self.state.data_epoch, self.state.data_step = epoch + 1, 0
            self._fire("on_epoch_end")
            self._maybe_log_evaluate_save(window, grad_norm)  # what on_epoch_end asked for (epoch strategies)
        if window:  # steps after the last log entry: in train_loss, as under Hugging Face
            window.fold()

    def _flop_params(self) -> int:
        """Non-embedding parameters, for Hugging Face's total_flos estimate (6 x parameters x tokens)."""
        if not hasattr(self, "_flop_param_count"):
            count = getattr(self.model, "num_parameters", None)
            self._flop_param_count = count(exclude_embeddings=True) if callable(count) else \
                sum(p.numel() for p in self.model.parameters())
        return self._flop_param_count
