"""The parts of `Trainer` that Hugging Face scripts call around training: evaluate / predict, saving the model,
metrics files, callbacks, dataloaders. Same names, arguments and files as `transformers.Trainer`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader
from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics
from transformers.trainer_utils import EvalLoopOutput, PredictionOutput

from shardtrain.checkpoint.full import DEFAULT_MAX_SHARD_BYTES
from shardtrain.errors import DataError, HubError, TrainingArgumentsError
from shardtrain.train.evaluation import EvalLoop, eval_loader, loader_source
from shardtrain.train.generation import eval_generator
from shardtrain.train.model_export import ModelExport
from shardtrain.train.streaming import is_stream
from shardtrain.train.validation import ModelLimits


class TrainerAPIMixin:
    """Part of `Trainer`: Hugging Face's public methods other than `train`."""

    # Hugging Face's own implementations; they only need is_world_process_zero, args.output_dir and state.
    log_metrics = log_metrics
    metrics_format = metrics_format
    save_metrics = save_metrics

    def save_state(self) -> None:
        """Write `output_dir/trainer_state.json` (rank 0), as Hugging Face's `save_state`."""
        if self.is_world_process_zero():
            self.state.save(Path(self.args.output_dir) / "trainer_state.json")

    def is_world_process_zero(self) -> bool:
        return self.rank == 0

    def is_local_process_zero(self) -> bool:
        return self.args.local_process_index == 0

    # -- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss averaged over every eval token on every rank, `compute_metrics`, and speed; logged. As Hugging
        Face: `get_eval_dataloader(eval_dataset)`, then `evaluation_loop` (each an override point)."""
        loader = self.get_eval_dataloader(eval_dataset)
        output = self.evaluation_loop(loader, "Evaluation", prediction_loss_only=True if self.compute_metrics is None
                                      else None, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self.log(output.metrics)
        self._fire("on_evaluate", metrics=output.metrics)
        return output.metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (and labels, loss and metrics when the data has labels) on every rank, in dataset order."""
        output = self.evaluation_loop(self.get_test_dataloader(test_dataset), "Prediction", ignore_keys=ignore_keys,
                                      metric_key_prefix=metric_key_prefix)
        self._fire("on_predict", metrics=output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Hugging Face's override point: evaluate `dataloader` on every rank.

        A loader from shardtrain's `get_eval_dataloader` / `get_test_dataloader` stands for its dataset, which is
        evaluated exactly (token sums over every rank, predictions gathered in dataset order); any other loader's
        batches (an override's) are this rank's, gathered in rank order.
        """
        loss_only = prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        source = loader_source(dataloader)
        output, samples = self._run_prediction(source, metric_key_prefix, with_predictions=not loss_only,
                                               ignore_keys=ignore_keys, keep_predictions=description == "Prediction"
                                               or not self.args.batch_eval_metrics)
        if source is dataloader:  # another loader's batches: the rows it gave (counted where predictions are kept)
            samples = len(output.predictions) if output.predictions is not None else 0
        return EvalLoopOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics,
                              num_samples=samples)

    def _run_prediction(self, dataset: Any, prefix: str, with_predictions: bool,
                        ignore_keys: list[str] | None = None,
                        keep_predictions: bool = True) -> tuple[PredictionOutput, int]:
        """Evaluate a dataset, or the batches of a loader that is not shardtrain's (see `evaluation_loop`); returns
        the output and the number of samples evaluated."""
        foreign = isinstance(dataset, DataLoader)
        if foreign and (self.dims.cp > 1 or self.dims.tp > 1):
            raise TrainingArgumentsError(
                "an overridden get_eval_dataloader/get_test_dataloader returned its own DataLoader while cp_size or "
                "tp_size > 1, whose ranks must evaluate the same samples; return super().get_eval_dataloader(...) "
                "(shardtrain's split of the dataset), or evaluate with cp_size and tp_size 1")
        stream = is_stream(dataset)
        if not (foreign or stream):
            self._validate_eval_dataset(dataset, f"{prefix}_dataset")
        batch_size = self.args.per_device_eval_batch_size * self.backend.devices_per_process
        # a prediction_step of the user's or a library's (Seq2SeqTrainer generates in it) replaces shardtrain's
        user_step = self._user_prediction_step(ignore_keys)
        generate = None
        if self.args.predict_with_generate and user_step is None:
            generate = eval_generator(self.model, causal_lm=self.loss_computer.shift_labels,
                                      max_length=self.args.generation_max_length,
                                      num_beams=self.args.generation_num_beams)
        loop = EvalLoop(self.model, self.loss_computer, self._eval_collator(), batch_size,
                        self.dp_rank, self.dims.batch_size, self.device, self.preprocess_logits_for_metrics,
                        seed=self.args.seed, on_step=self._prediction_batch_done, cp=self.cp,
                        prepare=lambda batch: self._model_inputs(batch, add_labels=False),
                        loss_group=self.meshes.loss.get_group(),
                        generate=generate,
                        collects=self._collects_predictions, backend=self.backend,
                        prediction_step=user_step, batch_metrics=self.args.batch_eval_metrics,
                        keep_predictions=keep_predictions,
                        inputs_key=getattr(self.model, "main_input_name", "input_ids")
                        if "inputs" in (self.args.include_for_metrics or []) else None)
        output, samples = loop.evaluate(dataset, prefix, self.compute_metrics, with_predictions)
        if self.state.epoch is not None and prefix == "eval":
            output.metrics["epoch"] = self.state.epoch
        return output, samples

    def _prediction_batch_done(self, steps: int | None) -> None:
        """on_prediction_step; callbacks see a sized `eval_dataloader` (Hugging Face's evaluation bar reads its
        length: this rank's batches)."""
        self.callback_handler.eval_dataloader = range(steps) if steps is not None else None  # a stream: unknown
        self._fire("on_prediction_step")

    def _user_prediction_step(self, ignore_keys: list[str] | None) -> Any:
        """`prediction_step` as the eval loop calls it, when the user overrode it or `compute_loss`; else None."""
        from shardtrain.train.training_step import TrainingStepMixin

        if type(self).prediction_step is TrainingStepMixin.prediction_step and not self._custom_loss:
            return None

        def step(inputs: dict, loss_only: bool) -> tuple:
            loss, logits, labels = self.prediction_step(self.model, inputs, loss_only, ignore_keys)
            if isinstance(logits, tuple | list):  # several outputs: the first is the predictions
                logits = logits[0] if logits else None
            return loss, logits, labels
        return step

    @property
    def _collects_predictions(self) -> bool:
        """One rank of each group that shares its samples (cp and tp ranks) contributes the predictions."""
        coords = self.dims.rank_coords(self.rank)
        return coords["cp"] == 0 and coords["tp"] == 0

    # -- dataloaders (for scripts that iterate themselves) ------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """This rank's micro-batches of the first epoch, exactly as `train()` draws them."""
        if self.train_dataset is None:
            raise DataError("get_train_dataloader() needs a train_dataset")
        data = self._training_data()
        return data.loader(data.plan(), epoch=0, start_step=0)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """This rank's contiguous share of the evaluation set, collated."""
        return self._share_loader(eval_dataset if eval_dataset is not None else self.eval_dataset, "eval_dataset")

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return self._share_loader(test_dataset, "test_dataset")

    def _validate_eval_dataset(self, dataset: Any, name: str) -> None:
        if dataset is None:
            raise DataError("evaluate()/predict() needs a dataset; pass Trainer(..., eval_dataset=...) or a dataset")
        self.dataset_checks.check(dataset, name, ModelLimits.of(self.model, self.loss_computer.shift_labels),
                                  need_targets=False)

    def _share_loader(self, dataset: Any, name: str) -> DataLoader:
        if not is_stream(dataset):
            self._validate_eval_dataset(dataset, name)
        return eval_loader(dataset, self._eval_collator(), batch_size=self.args.per_device_eval_batch_size,
                           dp_rank=self.dp_rank, dp_size=self.dims.batch_size, seed=self.args.seed)

    # -- saving ------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, *,
                   merge_adapters: bool = False, _gather_on_rank0: bool = False,
                   _max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
        """Write what `from_pretrained` loads: config.json (with `architectures`), safetensors,
        generation_config.json for generative models, and the processing class's files. Every rank calls it;
        the directory is checked before the model is gathered, and a failed write raises on every rank.

        A LoRA (PEFT) model writes its adapter (`adapter_model.safetensors` + `adapter_config.json`, gathered from
        every rank's shard: what `PeftModel.from_pretrained(base, dir)` loads), or with `merge_adapters=True` the
        base with the adapters merged in (peft's `merge_and_unload`), a plain transformers model.

        A whole FSDP2 model is written by every rank, none holding it whole (`checkpoint/hf_export.py`); adapters,
        merged adapters, XLA and non-float states are gathered on rank 0 (`_gather_on_rank0` forces that path:
        the benchmark compares the two).
        """
        return ModelExport(self.backend).save(self.model, Path(output_dir or self.args.output_dir),
                                              processing_class=self.processing_class,
                                              args_json=self.args.to_json_string(), merge_adapters=merge_adapters,
                                              gather_on_rank0=_gather_on_rank0, max_shard_bytes=_max_shard_bytes)

    def create_model_card(self, model_name: str | None = None, **kwargs: Any) -> None:
        """A short README.md in output_dir: what was trained, how, and the last logged results."""
        if not self.is_world_process_zero():
            return
        name = model_name or Path(self.args.output_dir).name
        evals = [e for e in self.state.log_history if any(k.startswith("eval_") for k in e)]
        lines = ["---", "library_name: transformers", "tags:", "- shardtrain", "- generated_from_trainer", "---",
                 "", f"# {name}", "", f"`{type(self.model).__name__}` trained with shardtrain (FSDP2) for "
                 f"{self.state.global_step} steps on {self.world_size} rank(s).", "", "## Training hyperparameters",
                 ""]
        for key in ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                    "lr_scheduler_type", "warmup_steps", "max_steps", "num_train_epochs", "optim"):
            lines.append(f"- {key}: {getattr(self.args, key)}")
        if evals:
            lines += ["", "## Results", "", "```json", json.dumps(evals[-1], indent=2), "```"]
        (Path(self.args.output_dir) / "README.md").write_text("\n".join(lines) + "\n")

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise HubError("shardtrain does not upload to the Hugging Face Hub; after save_model, upload the directory "
                       "with huggingface_hub (HfApi().upload_folder(folder_path=..., repo_id=...))")
