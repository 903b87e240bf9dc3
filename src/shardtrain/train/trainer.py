"""`Trainer`: a `transformers.Trainer` whose job runs on shardtrain's FSDP2 engine.

    trainer = Trainer(model, TrainingArguments("out", fsdp="full_shard"), train_dataset=ds)
    result = trainer.train()   # TrainOutput(global_step, training_loss, metrics), as in transformers
    # under `shardtrain launch` / torchrun on N ranks, or as one plain process

The loss of a step is the sum over every target token of the global batch (all ranks, all micro-steps)
divided by the number of those tokens, so a run depends on the global batch only, not on its split.
Callbacks are transformers' (`TrainerCallback`, `TrainerState`, `TrainerControl`), fired at the same points.

The class is Hugging Face's surface: its constructor, attributes, public methods and override points with Hugging
Face's signatures, each handing the work to a part with one job: `Runtime` (processes, meshes, device; from the
`RunSpec` resolved once), `ModelPreparation` (adapters, parallelism, weights, batches to model inputs),
`TrainingData` (which samples each rank draws at each step), `TrainingRun` (the loop), `Resume`, `OptimizerStep`
(the exact global-token step), `LossUnits`, `EvalLoop` (evaluation and prediction), `CheckpointManager`,
`ModelExport`, `MetricsLogger`; the parts call back through `train/hooks.py`. When to log, evaluate and save is
Hugging Face's `DefaultFlowCallback`. It is one class, not cut into mixins, so that a subclass (a user's, TRL's)
meets each of Hugging Face's methods in one place. See docs/architecture.md for the step, part by part.
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, Sampler, SequentialSampler
from transformers.integrations.neftune import activate_neftune, deactivate_neftune
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
)
from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics
from transformers.trainer_utils import (
    EvalLoopOutput,
    PredictionOutput,
    TrainerMemoryTracker,
    TrainOutput,
    speed_metrics,
)

from shardtrain.checkpoint.full import DEFAULT_MAX_SHARD_BYTES
from shardtrain.checkpoint.hf_files import saved_processor
from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.config import env
from shardtrain.config.run_spec import RunSpec
from shardtrain.errors import (
    DataError,
    TrainerOverrideError,
    TrainingArgumentsError,
    install_error_hook,
)
from shardtrain.parallel import layout_choice
from shardtrain.parallel.accelerate_bridge import LazyAccelerator
from shardtrain.parallel.runtime import Runtime
from shardtrain.train import verify
from shardtrain.train.args.checks import check_compute_metrics
from shardtrain.train.args.handover import engine_arguments
from shardtrain.train.args.hf_methods import REPLACED, label_names, owner, replaced_overrides, set_hf_attributes
from shardtrain.train.args.preflight import (
    DatasetChecks,
    check_model_source,
    check_output_dir,
    check_pipeline_inputs,
    check_training_inputs,
    resolve_resume,
)
from shardtrain.train.arguments import (
    TrainingArguments,
    take_accumulation_from_accelerator_config,
)
from shardtrain.train.data.batch_plan import BatchPlan, forward_columns
from shardtrain.train.data.collation import Collators
from shardtrain.train.data.packing import check_packing
from shardtrain.train.data.streaming import StreamPlan, check_stream_arguments, is_stream
from shardtrain.train.data.training_data import TrainingData
from shardtrain.train.data.user_loader import LoaderPlan
from shardtrain.train.data.validation import ModelLimits
from shardtrain.train.eval.loaders import ShareLoader, in_sampler_order
from shardtrain.train.hooks import TrainerLoopHooks, TrainerParts, flop_parameters, trainer_eval_loop
from shardtrain.train.hp_search import PrunedElsewhere, report_to_hp_search
from shardtrain.train.loop.replica_gate import ReplicaGate, check_replica_inputs, committed_steps, exit_finished
from shardtrain.train.loop.resume import Resume
from shardtrain.train.loop.run import TrainingRun, first_state, log_training_plan
from shardtrain.train.metrics.logger import MEASURED_KEYS, MetricsLogger, rank0_trackers
from shardtrain.train.model.export import ModelExport, save_through_override, skeleton, write_model_card
from shardtrain.train.model.lora import adapter_files
from shardtrain.train.model.preparation import SIDE_MODELS, ModelPreparation
from shardtrain.train.state import TrainerCallback, TrainerControl, TrainerState, store_callback_states
from shardtrain.train.step.guard import GuardedRun
from shardtrain.train.step.loss import LossComputer
from shardtrain.train.step.loss_units import LossUnits
from shardtrain.train.step.optim import (
    build_optimizer,
    build_scheduler,
    check_given_optimizer,
    steps_on_metric,
)
from shardtrain.train.step.optimizer_step import OptimizerStep
from shardtrain.train.step.preemption import PreemptionHandler
from shardtrain.train.step.router_loss import RouterLoss
from shardtrain.train.step.step_flow import BestMetric, LossWindow


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# an overridden get_resumed_dataloader is called on the loader of an overridden get_train_dataloader (LoaderPlan);
# the engine's own batch plan resumes at the checkpoint's step by itself, reading no batch it does not train on
RESUMED_LOADER_WARNING = (
    "get_resumed_dataloader is overridden ({owner}) but get_train_dataloader is not: shardtrain's batch plan "
    "resumes at the checkpoint's step without reading the batches before it, so the override is not called; it is "
    "called on resume, as Hugging Face calls it, when get_train_dataloader is overridden too")


class Trainer(transformers.Trainer):
    """A `transformers.Trainer` whose job runs on shardtrain's FSDP2 engine (see module docstring).

    The constructor is Hugging Face's (same arguments, same attributes); it does not build Accelerate's
    `Accelerator`: the backend sets up the process group, the meshes and the model's parallelism. Hugging
    Face's override points are called where Hugging Face calls them, with its signatures: `compute_loss`,
    `training_step` (one micro-batch: forward and backward), `prediction_step`, `evaluation_loop`,
    `create_optimizer`, `create_scheduler`, `get_decay_parameter_names`, `log`,
    `get_train_dataloader`/`get_eval_dataloader`, `_get_train_sampler`/`_get_eval_sampler`, `_prepare_inputs`,
    `_evaluate`, `_save_checkpoint`, `_load_optimizer_and_scheduler`; an overridden `_save` is called by
    `save_model`, an overridden `get_resumed_dataloader` (transformers >= 5.25) by a resume of an overridden
    `get_train_dataloader`'s loader. Every other method of Hugging Face's is inherited or replaced (`hf_methods`:
    overriding a replaced one is refused when the subclass is built). The engine's own public members, which its parts
    (`train/hooks.py`) read: `runtime`, `spec`, `preparation`, `loss_computer`, `pipeline`, `overrides(name)`,
    `custom_loss`, `call_event(event)`, `training_plan()`, `checkpoint_manager`.

    Args:
        model: an `nn.Module` (Hugging Face model or any module whose forward takes the batch keys), or the
            path of a pretrained directory (loaded on rank 0 only when `cpu_ram_efficient_loading`).
        args: `TrainingArguments` (default: output_dir "trainer_output").
        data_collator: batches a list of samples; default: `DataCollatorWithPadding` when `processing_class` is
            a tokenizer (as Hugging Face), else `PaddingCollator`.
        train_dataset: a map-style dataset of dicts (`datasets.Dataset` works) or a stream
            (`IterableDataset`, with `max_steps`).
        eval_dataset: a map-style dataset of dicts.
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
            (as TRL's trainers); a `PeftModel` passed as `model` works the same. See `shardtrain.train.model.lora`.
    """

    # a causal LM batch without labels learns every token; a library's trainer (shardtrain.on_engine) gets its
    # collator's batches as they are, as under Hugging Face
    labels_from_inputs = True
    # Hugging Face's own implementations; they only need is_world_process_zero, args.output_dir and state
    log_metrics, metrics_format, save_metrics = log_metrics, metrics_format, save_metrics

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass (a user's, or a library's through `on_engine`) that overrides a method of Hugging Face's that
        the engine never calls is refused here, when the class is built (`hf_methods`): honoured or refused,
        never skipped in silence."""
        super().__init_subclass__(**kwargs)
        found = replaced_overrides(cls, engine=Trainer)
        if found:
            install_error_hook()
            name, where = found[0]
            raise TrainerOverrideError(
                f"{where}.{name} overrides transformers.Trainer.{name}, which shardtrain's engine never calls (it "
                f"is replaced by {REPLACED[name]}); remove the override, or move its work to a method the engine "
                "calls (see the methods table in docs/hugging-face.md)")

    # the runtime's facts, read from it (never copied): backend, dims, meshes, cp, rank, world_size, device and
    # dp_rank (which samples this rank sees); libraries and scripts read them on the Trainer
    backend, dims, meshes, cp, rank, world_size, device, dp_rank = (
        property(lambda self, _name=name: getattr(self.runtime, _name), doc=f"`self.runtime.{name}`")
        for name in ("backend", "dims", "meshes", "cp", "rank", "world_size", "device", "dp_rank"))

    def overrides(self, name: str) -> bool:
        """Whether a subclass (a user's, a library's) defines `name` over shardtrain's and transformers'."""
        return owner(type(self), name) not in (Trainer, transformers.Trainer)

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
        # transformers' arguments (or a library's config) handed over as they are: taken over, with a warning
        args = engine_arguments(args) if args is not None else TrainingArguments(output_dir="trainer_output")
        self.args = args
        # Hugging Face's memory metrics (skip_memory_metrics=False): per stage, named after the calling method
        self._memory_tracker = TrainerMemoryTracker(args.skip_memory_metrics)
        self._memory_tracker.start()
        take_accumulation_from_accelerator_config(args)
        transformers.utils.logging.set_verbosity(args.get_process_log_level())  # Hugging Face's log_level
        if args.use_cpu:  # the device choice is read from the launcher's variable (also by DataLoader workers)
            os.environ[env.CPU] = env.true_word(True)
        # the run description (arguments, launcher environment, parallel sizes), resolved once, and the runtime
        # started from it: backend (FSDP2, or PyTorch/XLA with fsdp_config "xla": true), meshes, cp, device
        spec = RunSpec.resolve(args)
        # fsdp_config "layout": "auto": rank 0 traces the candidate layouts before the process group starts; the
        # runtime's spec is frozen with the choice (the arguments stay as given)
        self.compute_loss_func = compute_loss_func  # (read by `custom_loss`: a pipeline computes the loss itself)
        self.auto_layout = layout_choice.before_start(
            spec, args, model, train_dataset, can_pipeline=self.labels_from_inputs and not self.custom_loss
            and not args.predict_with_generate and not self.overrides("prediction_step"))
        self.runtime = runtime = Runtime.start(spec, model, chooser=self.auto_layout)
        self.spec = spec = runtime.spec
        self.preparation = ModelPreparation(runtime)
        # replica groups: group 0's rank 0 is the job's main process (logs, trackers, Hugging Face's files)
        self._replica_group = spec.fault_tolerance.replica_group if spec.fault_tolerance is not None else 0
        self._replica_gate: ReplicaGate | None = None
        check_output_dir(args.output_dir)
        set_seed(args.seed)
        self.model_init, self._peft_config = model_init, peft_config
        check_model_source(model, model_init, optimizers)
        if model is None:
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
        owns_loading = not self.labels_from_inputs and self.overrides("get_train_dataloader")
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
        self.compute_metrics = compute_metrics
        check_compute_metrics(args, compute_metrics)
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        check_given_optimizer(self.model, self.optimizer)
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        # Hugging Face's default callbacks: DefaultFlowCallback, and the display (a progress bar or a printer)
        self.callback_handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])], self.model,
                                                self.processing_class, self.optimizer, self.lr_scheduler)
        self.add_callback(PrinterCallback if args.disable_tqdm else ProgressCallback)  # Hugging Face's own
        for tracker in rank0_trackers(args.report_to, self.rank if self.is_world_process_zero() else -1):
            self.add_callback(tracker)
        if (wanted := verify.request()) is not None:  # `shardtrain verify`: its evidence, its figures, its end
            self.add_callback(verify.VerifyProbe(self, wanted))
        self.state = TrainerState(is_local_process_zero=args.local_process_index == 0,
                                  is_world_process_zero=self.is_world_process_zero())
        self.control = TrainerControl()
        self.logger = MetricsLogger(spec.output_dir, is_main=self.is_world_process_zero())
        self.preemption = PreemptionHandler()
        set_hf_attributes(self)
        if args.push_to_hub:  # the job's main process creates the repository, as Hugging Face's __init__
            self.init_hf_repo()
        self.call_event("on_init_end")
        self._memory_tracker.stop_and_update_metrics()

    # -- the model ----------------------------------------------------------------------------------------
    def _install_model(self, model: nn.Module | str) -> None:
        """Prepare `model` (adapters, parallelism, weights) and build what is bound to it: the loss, the router
        loss; the optimizer step and checkpoint manager follow it. `__init__` calls it, and `train()` with each
        model `model_init` builds."""
        args = self.args
        # an overridden `_save` (a library's writer) is handed a whole copy of the model on rank 0, built from this
        # skeleton (the module before sharding, on the meta device) and the gathered weights
        self._save_skeleton = skeleton(model) if self.overrides("_save") and isinstance(model, nn.Module) else None
        # total_flos counts the whole model's parameters: a pipeline's rank holds one stage once laid out
        whole = flop_parameters(model) if self.dims.pp > 1 else None
        self.model, self._frozen_base = self.preparation.prepare(model, self._peft_config)
        self.model_wrapped = self.model  # the model as it runs (FSDP2 shards the module in place)
        self.flop_parameters = whole if whole is not None else flop_parameters(self.model)
        self.pipeline = self.preparation.pipeline(self.model)  # this rank's stage and schedule (pp > 1)
        self.loss_computer = LossComputer.for_run(self.model, self.device, args, chunk=self.spec.loss_chunk_size,
                                                  tensor_parallel=self.dims.tp > 1)
        self.router_loss = RouterLoss(self.model, self.meshes.loss.get_group())
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

    def _parallelize_side_models(self) -> None:
        """A library's frozen extra models (TRL's `ref_model`, `teacher_model`, ...) sharded like the trained one,
        so that no rank holds a full copy while training."""
        for name in SIDE_MODELS:
            side = getattr(self, name, None)
            if isinstance(side, nn.Module) and side is not self.model:
                setattr(self, name, self.preparation.prepare_frozen(side))

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The Trainer's one `CheckpointManager` (it holds an async save in flight, its gloo group and buffers)."""
        manager = getattr(self, "_checkpoint_manager", None)
        # Hugging Face's run directory: output_dir, or output_dir/run-<trial> under hyperparameter_search
        root = Path(self._get_output_dir(getattr(self, "_trial", None)))
        if manager is None or manager.output_dir != root:  # built once per run directory, the parts registered
            if manager is not None:
                manager.close()
            manager = self._checkpoint_manager = CheckpointManager(
                root, parts=TrainerParts(self), state_dict_type=self.args.fsdp_config.state_dict_type,
                save_total_limit=self.args.save_total_limit, frozen_base=self._frozen_base,
                extra_files=adapter_files(self.model), state_access=self.backend.state_access,
                hf_layout=not self.args.fsdp_enabled, training_args=self.args)
        return manager

    # -- training -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Run the training loop; returns `TrainOutput(global_step, training_loss, metrics)`."""
        self._memory_tracker.start()
        args = self.args
        if self.model_init is not None:
            self._reinit_model(trial)
        self._hp_search_setup(trial)  # Hugging Face's: a trial's hyperparameters into args (and self._trial)
        self.backend.prepare_forward(self.model)  # after a library's own patches, as Accelerate's prepare
        check_training_inputs(args, train_dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                              cp_size=self.dims.cp, custom_loss=self.custom_loss)
        if self.pipeline is not None:
            check_pipeline_inputs(args, stages=self.dims.pp, custom_loss=self.custom_loss,
                                  loss_kind=self.loss_computer.kind, per_sample=self._loss_per_sample)
        self._check_datasets()
        ft = self.spec.fault_tolerance  # replica groups: the job's state is the output directory (newest checkpoint)
        resume = Resume.read(resolve_resume(resume_from_checkpoint if resume_from_checkpoint is not None
                                            else args.resume_from_checkpoint, output_dir=args.output_dir,
                                            auto=self.spec.restart_count > 0 or ft is not None,
                                            fsdp_enabled=args.fsdp_enabled, runtime=self.runtime))
        configured = args.per_device_train_batch_size  # (a trial of hyperparameter_search may have changed it)
        if not args.auto_find_batch_size or configured % self._train_batch_size:
            self._train_batch_size = configured
        if resume is not None and args.auto_find_batch_size:  # the batch the checkpointed run had come down to
            self._train_batch_size = resume.per_device_batch(configured)
        data, plan = self.training_plan()
        if isinstance(plan, StreamPlan):
            check_stream_arguments(args)
        elif isinstance(plan, LoaderPlan):
            plan.check_arguments(args)
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * plan.steps_per_epoch)
        if ft is not None:  # a group (re)started after the job finished ends here, writing nothing
            check_replica_inputs(args, plan, xla=self.spec.xla)
            if (done := committed_steps(self)) >= max_steps:
                exit_finished(self, done)
        self.create_optimizer_and_scheduler(max_steps)
        log_training_plan(args, plan, max_steps, dataset=self.train_dataset, model=self.model)
        self.state = first_state(args, plan, max_steps, rank=self.rank, train_batch_size=self._train_batch_size,
                                 stateful=[*self.callback_handler.callbacks, self.control])
        if resume is not None:
            self.state = resume.restore(self.checkpoint_manager, self.state, plan, max_steps, args=args, rank=self.rank)
            self._load_callback_state()  # Hugging Face's: stateful callbacks (and the control) as saved
            self._load_optimizer_and_scheduler(str(resume.path))  # (restored already; an override's own state)
            self.checkpoint_manager.saved_step = self.state.global_step  # its checkpoint exists
            if self.rank == 0:
                self.logger.truncate_after(self.state.global_step)  # steps after it will be logged again
        # this run's step (its max_grad_norm may be a trial's)
        self._guarded = GuardedRun.start(args.step_guard, self.state, args.output_dir, resuming=resume is not None,
                                         rank=self.rank)
        if ft is not None:  # joins the replica groups (a late group heals at its 1st step)
            self._replica_gate = ReplicaGate.start(self, ft, plan, max_steps)
        replicas = self._replica_gate.replicas if self._replica_gate is not None else None
        self._engine_step = OptimizerStep(model=self.model, dims=self.dims, device=self.device,
                                          all_reduce=self.backend.all_reduce, max_grad_norm=args.max_grad_norm,
                                          sharded=self.backend.is_sharded(self.model), loss=self.loss_computer,
                                          preemption=self.preemption, pipeline=self.pipeline, replicas=replicas,
                                          guard=self._guarded.guard if self._guarded is not None else None)
        start_step, start_time = self.state.global_step, time.time()
        window = LossWindow(self.backend.all_reduce, group=self.meshes.loss.get_group(),
                            nan_inf_filter=args.logging_nan_inf_filter)
        self.model.train()
        self.control.should_training_stop = False
        self.call_event("on_train_begin")
        self.logger.start(self.state.global_step, max_steps, self.state.num_input_tokens_seen)
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate()
        self.is_in_train = True
        self.preemption.install()
        neftune = activate_neftune(self.model, self.neftune_noise_alpha) if self.neftune_noise_alpha else None
        run = TrainingRun(state=self.state, guarded=self._guarded, logger=self.logger, rank=self.rank,
                          output_dir=args.output_dir, retry_on_oom=args.auto_find_batch_size,
                          gate=self._replica_gate)
        hooks = TrainerLoopHooks(self, self._engine_step, by_samples=self._loss_per_sample,
                                 ignore_keys=ignore_keys_for_eval)
        try:
            run.run(data, plan, max_steps, window, hooks)
        except PrunedElsewhere:  # rank 0's study pruned this trial (hp_search.py); rank 0 raised optuna's error
            return TrainOutput(self.state.global_step, window.training_loss, {})
        finally:
            if neftune is not None:
                deactivate_neftune(self.model, neftune)
            self.preemption.uninstall()
            self.is_in_train = False
            if self._replica_gate is not None:
                self._replica_gate.close()
        # An async save still in flight is committed (or its error raised on every rank) before train() returns.
        self._push_committed(self.checkpoint_manager.wait())
        self.logger.close()
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            self.checkpoint_manager.load(self.state.best_model_checkpoint, weights_only=True)
        self.checkpoint_manager.keep_best_only(self.state.best_model_checkpoint)
        steps = self.state.global_step - start_step
        metrics = speed_metrics("train", start_time, num_samples=steps * plan.global_batch_size, num_steps=steps)
        metrics.update(total_flos=self.state.total_flos, train_loss=window.training_loss, epoch=self.state.epoch)
        self._memory_tracker.stop_and_update_metrics(metrics)
        self.log(dict(metrics))
        self.logger.draw_report()
        self.call_event("on_train_end")
        self._finish_current_push()  # the uploads in flight, as Hugging Face waits for them
        return TrainOutput(self.state.global_step, window.training_loss, metrics)

    def _check_datasets(self) -> None:
        """The datasets against the model, before the first step (collective: every rank raises together)."""
        limits, checks = ModelLimits.of(self.model, self.loss_computer.shift_labels), self.dataset_checks
        if not is_stream(self.train_dataset):  # a stream is checked as it is read (its samples are not indexable)
            checks.check(self.train_dataset, "train_dataset", limits, need_targets=True, again=True)
            checks.report_unused_columns(self.train_dataset, "training", type(self.model).__name__)
        if self.eval_dataset is not None and self.args.eval_strategy != "no":
            checks.check_eval_sets(self.eval_dataset, limits)

    def training_plan(self) -> tuple[TrainingData, BatchPlan | StreamPlan | LoaderPlan]:
        """The training batches' part (at the per-device batch `auto_find_batch_size` came down to) and its plan:
        the engine's, or an overridden `get_train_dataloader`'s."""
        data = self._training_data()
        # Hugging Face's get_resumed_dataloader (transformers >= 5.25), called on resume where _run_epoch calls it
        resumed = hasattr(transformers.Trainer, "get_resumed_dataloader") and self.overrides("get_resumed_dataloader")
        if not self.overrides("get_train_dataloader"):
            if resumed and self.rank == 0:
                warnings.warn(RESUMED_LOADER_WARNING.format(owner=owner(type(self), "get_resumed_dataloader")
                                                            .__qualname__), stacklevel=2)
            return data, self._own_plan(data)
        return data, data.plan(self.get_train_dataloader, owner(type(self), "get_train_dataloader").__qualname__,
                               resumed=self.get_resumed_dataloader if resumed else None)

    def _own_plan(self, data: TrainingData) -> BatchPlan | StreamPlan:
        """The engine's plan over the train dataset, in the order of `_get_train_sampler` when it gives one."""
        return data.plan(sampler=None if is_stream(self.train_dataset) else self._get_train_sampler(self.train_dataset))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Hugging Face's hook on resume, called with the checkpoint once the checkpoint manager has restored the
        model, optimizer, scheduler and RNG (so ours loads nothing more): an override (GRPO's) that calls super()
        and then reads state of its own from `checkpoint` works as under Hugging Face."""

    def _training_data(self) -> TrainingData:
        """The training batches' part, at the per-device batch `auto_find_batch_size` came down to."""
        return TrainingData.of(self.args, self.runtime, self.train_dataset, self.data_collator,
                               per_device=self._train_batch_size)

    # -- Hugging Face's per-batch override points -------------------------------------------------------
    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """Hugging Face's override point: the loss of `inputs`, summed over their target tokens (or samples, for
        a model trained on its own loss) and divided by `num_items_in_batch` (those of the whole global batch of
        this step; in evaluation, of `inputs`).

        An override (or `compute_loss_func`) must return the loss in that convention (sum / num_items_in_batch)
        for N ranks and gradient accumulation to equal one process; one returning a mean over `inputs` is exact
        on one process without accumulation only. Under evaluation, Hugging Face's rule applies: the mean of
        the batches' losses, weighted by their samples.
        """
        if self.compute_loss_func is not None:
            labels = inputs["labels"]
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        else:
            # outputs asked for: with their logits (no chunked loss)
            loss_sum, outputs = self.loss_computer.compute(inputs, keep_logits=return_outputs)
            count = num_items_in_batch if num_items_in_batch is not None else self.loss_computer.items(inputs)
            loss = loss_sum / count
            if self.router_loss.enabled and model.training:  # MoE: + coef x load-balancing loss (router_loss.py),
                # this rank's share, averaged over the step's micro-batches (as the cross entropy is summed)
                micro = self.loss_computer.current
                loss = loss + self.router_loss.local_share(outputs, inputs) / (micro.count if micro else 1)
        if num_items_in_batch is not None:
            loss = self.loss_units.hf(loss)  # Hugging Face's convention (step/loss_units.py)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Hugging Face's override point: forward and backward of one micro-batch.

        Returns:
            the micro-batch's loss, detached: the sum of its token losses / `num_items_in_batch` (the target
            tokens of the global batch), so the micro-batches of every rank add up to the step's loss.
        """
        model.train()
        if not isinstance(inputs, Mapping):  # a library's batch (GRPO's prompts): its own inputs and loss
            return self._library_training_step(model, inputs)
        inputs = self._prepare_inputs(inputs)
        every = self.args.torch_empty_cache_steps
        if every and self.state.global_step % every == 0 and torch.cuda.is_available():
            torch.cuda.empty_cache()  # as Hugging Face: lower peak reserved memory, at a speed cost
        by_samples = self._loss_per_sample
        if num_items_in_batch is None:  # called on its own: this micro-batch's tokens (or samples)
            num_items_in_batch = self.loss_computer.items(inputs, by_samples=by_samples)
        if self.pipeline is not None:  # forward and backward over the stages: the schedule runs both
            micro_sum = self.loss_computer.through_pipeline(self.pipeline, inputs, num_items_in_batch)
            return self.loss_units.from_sum(micro_sum, num_items_in_batch)
        if by_samples:  # a mean over this micro-batch, weighted by its samples (placeholders: 0)
            loss = self.compute_loss(model, inputs)
            micro_sum = loss * self.loss_computer.items(inputs, by_samples=True)
        elif self.custom_loss or self.router_loss.enabled:
            # Hugging Face's compute_loss contract (and the router loss, added in token-sum units)
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            micro_sum = self.loss_units.to_sum(loss, num_items_in_batch)
        else:
            micro_sum = self.loss_computer(inputs)
        if self.loss_computer.placeholder:  # stands in for no sample: forward and backward (FSDP collectives), weight 0
            micro_sum = micro_sum * 0.0
        # the step's backward scale (None: training_step called on its own, which backpropagates its micro-batch's
        # mean loss, as Hugging Face's)
        micro = self.loss_computer.current
        scale = micro.grad_scale if micro is not None else 1 / num_items_in_batch
        (micro_sum * scale).backward()
        # Hugging Face's return: this micro-batch's share of the step loss, in its units
        return self.loss_units.from_sum(micro_sum.detach(), num_items_in_batch)

    def _library_training_step(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """Hugging Face's `training_step` on a batch only the library reads: its `_prepare_inputs` makes the model
        inputs (GRPO generates), its `compute_loss` the loss, divided by the accumulation steps unless the library
        did (`loss_is_scaled_for_ga`). This rank's loss is backpropagated as it is; FSDP averages the gradients
        over the ranks as DDP does under Hugging Face."""
        if self.dims.cp > 1 or self.dims.tp > 1:
            raise TrainingArgumentsError(
                f"{type(self).__name__}'s batches are its own ({type(inputs).__name__}: only its _prepare_inputs reads "
                f"them), which the engine cannot split over context- or tensor-parallel ranks (cp_size "
                f"{self.dims.cp}, tp_size {self.dims.tp}); train it with cp_size and tp_size 1")
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        if not self.loss_is_scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps
        loss.backward()
        return loss.detach()

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor | None, Any, Any]:
        """Hugging Face's override point: (loss, logits, labels) of one evaluation batch; the loss is the mean
        over the batch (from `compute_loss`), None without labels. When it (or `compute_loss`) is overridden,
        evaluation calls it once per batch and averages the losses over samples, as Hugging Face does; otherwise
        evaluation sums token losses exactly over every rank."""
        # Hugging Face's rule: a loss with every label present, or without labels when none are named and the
        # model (or the library: sentence-transformers sets can_return_loss) returns one
        has_labels = bool(self.label_names) and all(inputs.get(name) is not None for name in self.label_names)
        return_loss = inputs.get("return_loss")
        with_loss = has_labels or (not self.label_names and (self.can_return_loss if return_loss is None
                                                               else return_loss))
        inputs = self._prepare_inputs(inputs)
        ignore = set(ignore_keys or []) | {"loss"}
        with torch.no_grad():
            if with_loss:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach().mean()
                if isinstance(outputs, dict):
                    logits = outputs.get("logits") if "logits" not in ignore else None
                    if logits is None:
                        logits = next((v for k, v in outputs.items() if k not in ignore), None)
                else:  # (loss, prediction, ...): several predictions make a tuple, as Hugging Face's
                    rest = tuple(outputs[1:]) if isinstance(outputs, tuple | list) else ()
                    logits = rest[0] if len(rest) == 1 else (rest or None)
            else:
                loss, logits = None, self.loss_computer.logits(inputs)
        if prediction_loss_only:
            return loss, None, None
        labels = tuple(inputs[name] for name in self.label_names) if with_loss else None  # (): none named
        return loss, logits, (labels[0] if labels is not None and len(labels) == 1 else labels)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face's hook: the batch as the model gets it (on the device); called by `training_step` and
        `prediction_step`. The Trainer's own batches arrive prepared (and split under context parallelism)."""
        if all(not isinstance(v, torch.Tensor) or v.device == self.device for v in inputs.values()):
            return inputs
        return self.backend.to_device(inputs)

    @property
    def custom_loss(self) -> bool:
        return self.overrides("compute_loss") or self.compute_loss_func is not None

    @property
    def loss_units(self) -> LossUnits:
        """The conversions between the engine's token sums and Hugging Face's loss units (`step/loss_units.py`;
        `average_tokens_across_devices` may change between hyperparameter trials)."""
        return LossUnits.of(world_size=self.world_size, copies=self.dims.data_copies,
                            average_tokens_across_devices=self.args.average_tokens_across_devices)

    @property
    def _loss_per_sample(self) -> bool:
        """Whether `compute_loss` returns a mean over its micro-batch (Hugging Face's `loss_is_scaled_for_ga`
        False, e.g. TRL's DPO): such a loss is weighted by the micro-batch's samples; otherwise it is the sum
        over target tokens divided by `num_items_in_batch`."""
        return self.loss_is_scaled_for_ga is False

    # -- optimizer and scheduler (Hugging Face's override points) ----------------------------------------
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Hugging Face's: `create_optimizer()`, then `create_scheduler(num_training_steps)`."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Hugging Face's optimizer: `get_decay_parameter_names` grouping, `optimizer_cls_and_kwargs` or
        `get_optimizer_cls_and_kwargs(args)`, built on the sharded parameters the Trainer holds (`build_optimizer`,
        which `shardtrain plan` traces too)."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = build_optimizer(opt_model, decay_names=self.get_decay_parameter_names(opt_model),
                                             weight_decay=self.args.weight_decay, cls=cls, kwargs=kwargs)
        return self.optimizer

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: transformers.TrainingArguments, model: Any = None) -> tuple[Any, Any]:
        """Hugging Face's choice for `args.optim`; the fused AdamW kernel only where torch has one (CPU, CUDA)."""
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        devices = {p.device.type for p in model.parameters()} if model is not None else set()
        if kwargs.get("fused") and not devices <= {"cpu", "cuda"}:
            kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
        return cls, kwargs

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """transformers' scheduler for `lr_scheduler_type` (warmup: `warmup_steps`, a ratio when below 1)."""
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, self.args, num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # -- logging, evaluation and saving during training -----------------------------------------------------
    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict:
        """Hugging Face's: evaluate during training, report a trial's objective, and step a scheduler that steps on
        the metric (the same on every rank: evaluate() agrees on it)."""
        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        self._report_to_hp_search(trial, self.state.global_step, metrics)  # a trial's intermediate value
        if steps_on_metric(self.lr_scheduler) and not skip_scheduler:
            self.lr_scheduler.step(BestMetric.of(self.args).value(metrics))
        return metrics

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Hugging Face's hook (same signature, so a library's override that calls super() works): write
        `checkpoint-<step>` of the Trainer's model, optimizer, scheduler, RNG and state."""
        if not self._writes_job_files:
            return
        manager = self.checkpoint_manager
        store_callback_states(self.state, [*self.callback_handler.callbacks, self.control])
        if self.args.save_async:  # the previous save is committed first (save_async would wait for it too)
            committed = manager.wait()
            manager.save_async(self.state.global_step, self.state, model_only=self.args.save_only_model)
        else:
            committed = manager.save(self.state.global_step, self.state, model_only=self.args.save_only_model)
        self._push_committed(committed)
        self.call_event("on_save")

    def _push_committed(self, checkpoint: Path | None) -> None:
        """push_to_hub: a committed checkpoint goes to Hugging Face's `_push_from_checkpoint` (main process only,
        per `hub_strategy`); an async one when it is committed."""
        if checkpoint is not None and self.args.push_to_hub:
            self._push_from_checkpoint(str(checkpoint))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record `logs` for this step in `log_history`, metrics.jsonl, the trackers and the progress bar.
        `log_history` (saved in trainer_state.json) keeps Hugging Face's keys: the measured throughput and memory,
        which differ from run to run, go to metrics.jsonl and the trackers only. As Hugging Face's, `logs` itself
        gets the epoch (evaluate() returns the metrics it logged, epoch included, under any prefix)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        entry = {**logs, "epoch": round(self.state.epoch or 0.0, 4), "step": self.state.global_step}
        self.state.log_history.append({k: v for k, v in entry.items() if k not in MEASURED_KEYS})
        self.logger.log(entry)
        self.call_event("on_log", logs=entry)

    def call_event(self, event: str, **kwargs: Any) -> None:
        """Fire `event` through transformers' `CallbackHandler` (it passes the model, processing class, optimizer
        and scheduler, as in Hugging Face's Trainer); a returned control replaces ours."""
        handler = self.callback_handler
        handler.model, handler.processing_class = self.model, self.processing_class
        handler.optimizer, handler.lr_scheduler = self.optimizer, self.lr_scheduler
        # the handler's own method: it resets the flag the event answers (on_log: should_log, ...), as in transformers
        self.control = getattr(handler, event)(self.args, self.state, self.control, **kwargs)

    # -- evaluation and prediction ---------------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss averaged over every eval token on every rank, `compute_metrics`, and speed; logged. As Hugging
        Face: `get_eval_dataloader(eval_dataset)`, then `evaluation_loop` (each an override point). A dict of
        datasets (a `DatasetDict` too) is evaluated one by one under `<prefix>_<name>`, as Hugging Face."""
        named = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(named, dict):
            metrics: dict[str, float] = {}
            for name, dataset in named.items():  # a name, so an override of get_eval_dataloader sees Hugging Face's
                metrics.update(self.evaluate(dataset if eval_dataset is not None else name, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        self._memory_tracker.start()
        loader = self.get_eval_dataloader(eval_dataset)
        output = self.evaluation_loop(loader, "Evaluation", prediction_loss_only=True if self.compute_metrics is None
                                      else None, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self.log(output.metrics)
        if self.logger.report_drawn:  # an evaluation after training (the final one) joins report.png
            self.logger.draw_report()
        self.call_event("on_evaluate", metrics=output.metrics)
        self._memory_tracker.stop_and_update_metrics(output.metrics)
        return output.metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (and labels, loss and metrics when the data has labels) on every rank, in dataset order."""
        self._memory_tracker.start()
        output = self.evaluation_loop(self.get_test_dataloader(test_dataset), "Prediction", ignore_keys=ignore_keys,
                                      metric_key_prefix=metric_key_prefix)
        self.call_event("on_predict", metrics=output.metrics)
        self._memory_tracker.stop_and_update_metrics(output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Hugging Face's override point: evaluate `dataloader` on every rank (`EvalLoop`).

        The `ShareLoader` of shardtrain's `get_eval_dataloader` / `get_test_dataloader` holds this rank's share of
        the dataset, evaluated exactly (token sums over every rank, predictions gathered in dataset order); any
        other loader's batches (an override's) are this rank's, gathered in rank order.
        """
        self.backend.prepare_forward(self.model)
        loss_only = prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        loop = trainer_eval_loop(self, description, ignore_keys)
        output, samples = loop.evaluate(dataloader, metric_key_prefix, self.compute_metrics, not loss_only)
        if self.state.epoch is not None and metric_key_prefix == "eval":
            output.metrics["epoch"] = self.state.epoch
        return EvalLoopOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics,
                              num_samples=samples)

    # -- dataloaders (for scripts that iterate themselves) ------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """This rank's micro-batches of the first epoch, exactly as `train()` draws them."""
        if self.train_dataset is None:
            raise DataError("get_train_dataloader() needs a train_dataset")
        data = self._training_data()
        return data.loader(self._own_plan(data), epoch=0, start_step=0)

    def _get_train_sampler(self, train_dataset: Any = None) -> Sampler | None:
        """Hugging Face's override point: the sampler whose order each epoch's global batches follow (the same
        on every rank; a library's, e.g. GRPO's repeated prompts, is honoured). None: the engine's seeded
        permutation per epoch (`train_sampling_strategy="random"`), independent of the layout."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy == "sequential" and dataset is not None and not is_stream(dataset):
            return SequentialSampler(dataset)
        return None

    def _get_eval_sampler(self, eval_dataset: Any) -> Sampler | None:
        """Hugging Face's override point: the order in which the evaluation set is read (an override's is
        honoured: the samples are evaluated, and predictions returned, in its order). None: dataset order."""
        return None

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """This rank's contiguous share of the evaluation set, collated (a str names one of a dict of sets)."""
        if isinstance(eval_dataset, str):
            return self._share_loader(self.eval_dataset[eval_dataset], f"eval_dataset[{eval_dataset!r}]")
        return self._share_loader(eval_dataset if eval_dataset is not None else self.eval_dataset, "eval_dataset")

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return self._share_loader(test_dataset, "test_dataset")

    def _share_loader(self, dataset: Any, name: str) -> DataLoader:
        if not is_stream(dataset):  # checked against the model, then in `_get_eval_sampler`'s order
            self.dataset_checks.check_eval(dataset, name, ModelLimits.of(self.model, self.loss_computer.shift_labels))
            dataset = in_sampler_order(dataset, self._get_eval_sampler(dataset))
        # padded even when training packs sequences
        collator = self.data_collator if self._unpacked_collator is None else self._unpacked_collator
        return ShareLoader(dataset, collator, batch_size=self.args.per_device_eval_batch_size *
                           self.backend.devices_per_process, dp_rank=self.dp_rank, dp_size=self.dims.batch_size,
                           seed=self.args.seed, drop_last=self.args.dataloader_drop_last)

    # -- saving ------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, *,
                   merge_adapters: bool = False, _gather_on_rank0: bool = False,
                   _max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
        """Write what `from_pretrained` loads (`ModelExport`): config.json, safetensors, generation_config.json for
        generative models, and the processing class's files. Every rank calls it; the directory is checked before
        the model is gathered, and a failed write raises on every rank.

        A LoRA (PEFT) model writes its adapter (what `PeftModel.from_pretrained(base, dir)` loads), or with
        `merge_adapters=True` the base with the adapters merged in (peft's `merge_and_unload`). A whole FSDP2 model
        is written by every rank, none holding it whole; adapters, merged adapters, XLA and non-float states are
        gathered on rank 0 (`_gather_on_rank0` forces that path: the benchmark compares the two).
        """
        out = Path(output_dir or self.args.output_dir)
        if not self._writes_job_files:  # another replica group writes the job's model
            return out
        if self.overrides("_save"):  # a library's own writer (sentence-transformers'), as Hugging Face calls it
            path = save_through_override(self, out)
        else:
            path = ModelExport(self.backend).save(
                self.model, out, processing_class=saved_processor(self.processing_class, self.data_collator),
                args_json=self.args.to_json_string(), merge_adapters=merge_adapters, gather_on_rank0=_gather_on_rank0,
                max_shard_bytes=_max_shard_bytes)
        if self.args.push_to_hub and not _internal_call:  # as Hugging Face: output_dir saved again, then uploaded
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return path

    def save_state(self) -> None:
        """Write `output_dir/trainer_state.json` (rank 0), as Hugging Face's `save_state`."""
        if self.is_world_process_zero():
            self.state.save_to_json(Path(self.args.output_dir) / "trainer_state.json")

    def create_model_card(self, model_name: str | None = None, **kwargs: Any) -> None:
        """A short README.md in output_dir: what was trained, how, and the last logged results."""
        if self.is_world_process_zero():
            write_model_card(Path(self.args.output_dir), name=model_name or Path(self.args.output_dir).name,
                             model=self.model, args=self.args, state=self.state, world_size=self.world_size)

    # -- Hugging Face's internals that libraries built on the Trainer read ----------------------------------
    def is_world_process_zero(self) -> bool:
        return self.rank == 0 and self._replica_group == 0

    @property
    def _writes_job_files(self) -> bool:
        """Whether this process's group writes the job's checkpoints and model (all but one replica group don't)."""
        return self._replica_gate is None or self._replica_gate.writes

    def is_local_process_zero(self) -> bool:
        return self.args.local_process_index == 0

    @property
    def callbacks(self) -> list[TrainerCallback]:
        return self.callback_handler.callbacks

    # An Accelerate `Accelerator` on shardtrain's process group, for the code of libraries built on Hugging Face's
    # Trainer (`gather_for_metrics`, `num_processes`, `unwrap_model`, `is_main_process`). It never wraps, shards
    # or moves the model: shardtrain's backend does that. Built on first use.
    accelerator = LazyAccelerator()

    def create_accelerator_and_postprocess(self) -> None:
        """Hugging Face's hook after a trial's arguments are set: the engine's `accelerator` is rebuilt on next
        use (from the new arguments); no Accelerate plugin is ever created."""
        self.accelerator = None

    def _report_to_hp_search(self, trial: Any, step: int, metrics: dict[str, float]) -> None:
        """Hugging Face's: a trial's intermediate objective to its study (which may prune it); on several ranks,
        rank 0's decision is every rank's (`shardtrain.train.hp_search`)."""
        report_to_hp_search(self, trial, step, metrics)

    def _set_signature_columns_if_needed(self) -> None:
        """Hugging Face's hook: the dataset columns `remove_unused_columns` keeps (the model's forward
        parameters and the label names)."""
        if self._signature_columns is None:  # as Hugging Face: with the label names
            self._signature_columns = sorted(forward_columns(self.model) | {"label", "label_ids",
                                                                            *label_names(self.model, self.args)})

    def get_tp_size(self) -> int:
        return self.dims.tp

    def get_cp_size(self) -> int:
        return self.dims.cp

    def get_sp_size(self) -> int:
        return 1
