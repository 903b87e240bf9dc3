"""The Trainer's side of its parts' callbacks: `TrainerLoopHooks` for the loop (`TrainingRun`),
`TrainerStepHooks` for one optimizer step (`OptimizerStep`) and `TrainerEvalHooks` for evaluation
(`EvalLoop`). They are where the engine's parts meet Hugging Face's surface: callbacks fired through the
Trainer's handler, `training_step` and `prediction_step` called with Hugging Face's signatures, the Trainer's
optimizer and scheduler stepped. They read the Trainer's public members; the private names they call are Hugging
Face's own override points and attributes (`_evaluate`, `_save_checkpoint`, `_get_output_dir`, `_trial`,
`_train_batch_size`), called where Hugging Face's loop calls them, so a subclass's override is honoured.

    TrainingRun.run(...) -> TrainerLoopHooks.optimizer_step -> OptimizerStep.run
        -> TrainerStepHooks.micro_step(MicroStep) -> Trainer.training_step -> compute_loss
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerControl

from shardtrain.checkpoint.hf_files import saved_processor
from shardtrain.checkpoint.layout import PREFIX
from shardtrain.errors import TrainingArgumentsError
from shardtrain.parallel.accelerate_bridge import LazyAccelerator
from shardtrain.parallel.fsdp import reshard_all
from shardtrain.train.data.training_data import Plan, TrainingData
from shardtrain.train.eval.generation import eval_generator
from shardtrain.train.eval.loop import EvalLoop, EvalSettings
from shardtrain.train.step.batch_finder import smaller_batch
from shardtrain.train.step.micro import MicroStep
from shardtrain.train.step.optim import discard_step, step_optimizer_and_scheduler
from shardtrain.train.step.optimizer_step import OptimizerStep, StepResult
from shardtrain.train.step.step_flow import BestMetric, LossWindow


class TrainerParts:
    """A Trainer's stateful parts as its `CheckpointManager` reads them (registered once, read at each save and
    load: the optimizer and scheduler appear in `train()`, a `model_init` run brings a new model)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def model(self) -> Any:
        return self.trainer.model

    @property
    def optimizer(self) -> Any:
        return self.trainer.optimizer

    @property
    def scheduler(self) -> Any:
        return self.trainer.lr_scheduler

    @property
    def processor(self) -> Any:  # the tokenizer, or the one a collator holds, as transformers saves it
        return saved_processor(self.trainer.processing_class, self.trainer.data_collator)


def flop_parameters(model: torch.nn.Module | str | os.PathLike) -> int:
    """The parameters of Hugging Face's flos estimate (`num_parameters(exclude_embeddings=True)`) of the whole
    model (sharded parameters count whole). A saved model's are counted on a copy built on the meta device."""
    if isinstance(model, str | os.PathLike):
        from transformers import AutoConfig

        from shardtrain.model_facts import model_class_from_config

        cls, config = model_class_from_config(Path(model)), AutoConfig.from_pretrained(model)
        with torch.device("meta"):
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    count = getattr(model, "num_parameters", None)
    return count(exclude_embeddings=True) if callable(count) else sum(p.numel() for p in model.parameters())


class TrainerLoopHooks:
    """`LoopHooks` on a Trainer (`trainer`: shardtrain's `Trainer`, or a subclass) for one `train()`: `step` runs
    each optimizer step (`by_samples`: the loss is a mean per micro-batch, weighted by its samples);
    `ignore_keys`: `train(ignore_keys_for_eval=...)`, for the evaluations during training."""

    def __init__(self, trainer: Any, step: OptimizerStep, *, by_samples: bool = False,
                 ignore_keys: list[str] | None = None) -> None:
        self.trainer, self.step, self.by_samples, self.ignore_keys = trainer, step, by_samples, ignore_keys
        self.flop_params = trainer.flop_parameters  # Hugging Face's total_flos: 6 x these x input tokens

    @property
    def control(self) -> TrainerControl:
        return self.trainer.control

    def fire(self, event: str) -> None:
        self.trainer.call_event(event)

    def log(self, logs: dict[str, float]) -> None:
        self.trainer.log(logs)

    def optimizer_step(self, batches: list[Any], placeholders: list[bool]) -> StepResult:
        """`training_step` on each micro-batch, then clip and step (`OptimizerStep`); the state counts the step's
        input tokens and Hugging Face's flos estimate."""
        trainer = self.trainer
        with_labels = trainer.labels_from_inputs  # a library's trainer gets its collator's batches as they are
        batches = [trainer.preparation.inputs(b, trainer.loss_computer, with_labels=with_labels)
                   if isinstance(b, Mapping) else b for b in batches]
        trainer.current_gradient_accumulation_steps = len(batches)  # Hugging Face's, read by libraries' losses
        result = self.step.run(batches, placeholders, TrainerStepHooks(trainer), step=trainer.state.global_step,
                               by_samples=self.by_samples)
        trainer.state.num_input_tokens_seen += result.input_tokens
        trainer.state.total_flos += 6.0 * self.flop_params * result.input_tokens
        return result

    def log_evaluate_save(self, window: LossWindow, last: StepResult | None) -> None:
        """Hugging Face's `_maybe_log_save_evaluate`: log (the losses of the steps in `window`), evaluate, save,
        as the `control` flags say (each event resets its flag)."""
        trainer = self.trainer
        args, state, step, best = trainer.args, trainer.state, trainer.state.global_step, BestMetric.of(trainer.args)
        if window and trainer.control.should_log:
            losses = window.fold()
            # a window holds steps, so `last` is one of them
            logs = {"loss": sum(losses) / len(losses), "grad_norm": float(last.grad_norm),
                    "learning_rate": last.learning_rate,
                    **trainer.logger.throughput_and_memory(trainer.backend.all_gather, trainer.device)}
            trainer.log(logs)
        metrics = None
        if trainer.control.should_evaluate:
            metrics = trainer._evaluate(trainer._trial, self.ignore_keys)
            if args.save_strategy == "best":
                trainer.control.should_save = best.improves(metrics, state.best_metric)
        if trainer.control.should_save:
            # the best checkpoint is the one about to be written (Hugging Face: _determine_best_metric first)
            best.record(state, metrics, str(Path(trainer._get_output_dir(trainer._trial)) / f"{PREFIX}{step}"))
            trainer._save_checkpoint(trainer.model, trainer._trial)
        elif metrics is not None:
            best.record(state, metrics)

    def smaller_batch(self, err: BaseException) -> tuple[TrainingData, Plan]:
        """`auto_find_batch_size`: a step ran out of memory; cut the per-device batch and grow the accumulation
        steps by the same factor (`batch_finder`), every rank alike, so the global batch stays the same."""
        trainer = self.trainer
        configured = trainer.args.per_device_train_batch_size
        smaller = smaller_batch(trainer._train_batch_size, configured)
        trainer.optimizer.zero_grad(set_to_none=True)  # whatever the failed step had accumulated
        trainer.backend.step_end()
        if trainer.backend.is_sharded(trainer.model):
            reshard_all(trainer.model)
        failed, trainer._train_batch_size = trainer._train_batch_size, smaller
        trainer.state.train_batch_size = smaller
        data, plan = trainer.training_plan()
        if trainer.rank == 0:
            print(f"warning: auto_find_batch_size: step {trainer.state.global_step + 1} ran out of memory with "
                  f"{failed} samples per device ({type(err).__name__}); going on with {smaller} x "
                  f"{data.accumulation_steps} accumulation steps, the same global batch", file=sys.stderr, flush=True)
        return data, plan

    def checkpoint_for_exit(self) -> None:
        trainer = self.trainer
        if trainer.checkpoint_manager.saved_step != trainer.state.global_step:
            trainer._save_checkpoint(trainer.model, trainer._trial)
        trainer.checkpoint_manager.wait()


class TrainerStepHooks:
    """`StepHooks` on a Trainer: Hugging Face's `training_step` on each micro-batch, its callbacks between
    micro-batches and around the optimizer step, and the scheduler's step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def micro_step(self, micro: MicroStep) -> torch.Tensor:
        trainer, num_items = self.trainer, micro.num_items
        # Hugging Face sets Accelerate's sync_gradients per micro-batch (TRL's GRPO reads it); only an
        # accelerator a library has asked for exists
        accelerator = LazyAccelerator.built(trainer)
        if accelerator is not None:
            accelerator.gradient_state._set_sync_gradients(micro.is_last)
        try:  # (training_step reads the rest of `micro` as the loss's current micro-step)
            loss = trainer.training_step(trainer.model, micro.batch, num_items)
        finally:
            if accelerator is not None:
                accelerator.gradient_state._set_sync_gradients(True)  # outside a step, as Accelerate's
        # Hugging Face's return is the micro-batch's share of the step loss: back to its sum (a library's own
        # loss, num_items None, is its mean already)
        loss = loss.detach().float()
        return trainer.loss_units.to_sum(loss, num_items) if num_items is not None else loss

    def between_micro_steps(self) -> None:
        self.trainer.call_event("on_substep_end")

    def discard_step(self) -> float:
        trainer = self.trainer
        return discard_step(trainer.optimizer, trainer.lr_scheduler, trainer.backend)

    def optimizer_step(self) -> float:
        trainer = self.trainer
        return step_optimizer_and_scheduler(trainer.optimizer, trainer.lr_scheduler, trainer.backend,
                                            fire=trainer.call_event)


class TrainerEvalHooks:
    """`EvalHooks` on a Trainer for one `evaluation_loop` call: its model inputs, an overridden `prediction_step`
    (or `compute_loss`: Seq2SeqTrainer's, TRL's) in place of the engine's forward, `generate` under
    `predict_with_generate`, `preprocess_logits_for_metrics`, `on_prediction_step` after each batch."""

    def __init__(self, trainer: Any, ignore_keys: list[str] | None) -> None:
        self.trainer, self.ignore_keys, args = trainer, ignore_keys, trainer.args
        self.own_step = trainer.overrides("prediction_step") or trainer.custom_loss
        if self.own_step and trainer.pipeline is not None:
            raise TrainingArgumentsError(
                f"pp_size = {trainer.dims.pp} with an overridden prediction_step / compute_loss: evaluation under a "
                "pipeline runs the stages' forward and the token loss on the last stage; use the default ones, or "
                "pp_size 1")
        self.generates = bool(args.predict_with_generate) and not self.own_step
        self._generator = eval_generator(trainer.model, causal_lm=trainer.loss_computer.shift_labels,
                                         max_length=args.generation_max_length,
                                         num_beams=args.generation_num_beams) if self.generates else None

    def model_inputs(self, batch: dict) -> dict:
        return self.trainer.preparation.inputs(batch, self.trainer.loss_computer, with_labels=False)

    def prediction_step(self, inputs: dict, loss_only: bool) -> tuple:
        trainer = self.trainer
        loss, logits, labels = trainer.prediction_step(trainer.model, inputs, loss_only, self.ignore_keys)
        if isinstance(logits, list):
            logits = tuple(logits)
        return loss, (logits or None) if isinstance(logits, tuple) else logits, labels

    def generate(self, batch: dict) -> tuple[list, list]:
        return self._generator(batch)

    def preprocess(self, logits: Any, labels: Any) -> Any:
        preprocess = self.trainer.preprocess_logits_for_metrics
        return preprocess(logits, labels) if preprocess is not None else logits

    def batch_done(self, steps: int | None) -> None:
        # callbacks see a sized eval_dataloader (Hugging Face's bar reads it); a stream's is unknown
        self.trainer.callback_handler.eval_dataloader = range(steps) if steps is not None else None
        self.trainer.call_event("on_prediction_step")


def trainer_eval_loop(trainer: Any, description: str, ignore_keys: list[str] | None) -> EvalLoop:
    """The `EvalLoop` of one `evaluation_loop` call ("Evaluation" or "Prediction") on `trainer`."""
    args = trainer.args
    settings = EvalSettings(per_device_batch_size=args.per_device_eval_batch_size,
                            batch_metrics=args.batch_eval_metrics,
                            keep_predictions=description == "Prediction" or not args.batch_eval_metrics,
                            inputs_key=getattr(trainer.model, "main_input_name", "input_ids")
                            if "inputs" in (args.include_for_metrics or []) else None,
                            label_names=tuple(trainer.label_names))
    return EvalLoop(trainer.runtime, trainer.model, trainer.loss_computer, settings,
                    TrainerEvalHooks(trainer, ignore_keys), pipeline=trainer.pipeline)
