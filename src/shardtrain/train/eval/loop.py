"""Evaluation over a dataset split across ranks: exact token-weighted loss, gathered predictions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from transformers import EvalPrediction
from transformers.trainer_utils import PredictionOutput, speed_metrics

from shardtrain.errors import DataError, TrainingArgumentsError
from shardtrain.model_facts import IGNORE_INDEX
from shardtrain.parallel import collectives
from shardtrain.parallel.collectives import over_data_ranks, per_rank
from shardtrain.parallel.context import SHARD_KWARG
from shardtrain.parallel.fsdp import reshard_all
from shardtrain.parallel.pipeline import Pipeline
from shardtrain.parallel.runtime import Runtime
from shardtrain.train.eval.loaders import PendingBatch, ShareLoader
from shardtrain.train.step.loss import LABEL_KEYS, LossComputer, batch_rows
from shardtrain.train.step.micro import EVAL_PLACEHOLDER

_NOT_RETURNED = object()  # no prediction_step ran: the batch's own labels are collected


def _first_rows(batch: dict[str, Any], rows: int) -> dict[str, Any]:
    """The first `rows` samples of a collated batch (tensors whose first dimension is the batch)."""
    size = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {k: v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size else v
            for k, v in batch.items()}


def _ignored(labels: Any) -> Any:
    return torch.full_like(labels, IGNORE_INDEX) if isinstance(labels, torch.Tensor) else labels


def _stack_padded(rows: list[Any]) -> Any:
    """The rows stacked into one array, padded with -100 where their lengths differ; rows of several outputs
    (tuples, Hugging Face's predictions of a model with more than one) stack into a tuple of arrays."""
    if not rows:
        return np.zeros((0,))
    if isinstance(rows[0], tuple):
        return tuple(_stack_padded([row[k] for row in rows]) for k in range(len(rows[0])))
    if rows[0].ndim == 0 or all(r.shape == rows[0].shape for r in rows):
        return np.stack(rows)
    longest = max(r.shape[0] for r in rows)
    out = np.full((len(rows), longest, *rows[0].shape[1:]), IGNORE_INDEX, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, :row.shape[0]] = row
    return out


def _tensors(stacked: Any) -> Any:
    """Stacked rows as tensors (a tuple of outputs: a tuple of tensors)."""
    return tuple(torch.as_tensor(part) for part in stacked) if isinstance(stacked, tuple) else torch.as_tensor(stacked)


def _rows(indices: list[int], batch: dict, values: torch.Tensor) -> list[np.ndarray]:
    """The real rows (index >= 0) of a batch tensor on the host, per-token ones (as long as the attention mask)
    cut at their mask's length (so a row does not depend on the padding of the batch it fell into)."""
    values = values.cpu().numpy()
    mask = batch.get("attention_mask")
    per_token = mask is not None and values.ndim > 1 and values.shape[1] == mask.shape[-1]
    lengths = mask.sum(-1).tolist() if per_token else None
    return [values[row, :lengths[row]] if lengths is not None else values[row]
            for row, index in enumerate(indices) if index >= 0]


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """How one evaluation runs, fixed for its length (from the Trainer's arguments).

    Attributes:
        per_device_batch_size: the batch of one device (a `ShareLoader`'s global batch is it x the data ranks).
        batch_metrics: Hugging Face's `batch_eval_metrics`: `compute_metrics(EvalPrediction, compute_result)`
            after every batch.
        keep_predictions: False: no predictions are returned (Hugging Face's evaluate() under batch metrics).
        inputs_key: `include_for_metrics=["inputs"]`: this batch key's rows go to `EvalPrediction.inputs`.
        label_names: the batch keys holding labels (several: `label_ids` is a tuple of arrays).
    """

    per_device_batch_size: int
    batch_metrics: bool = False
    keep_predictions: bool = True
    inputs_key: str | None = None
    label_names: tuple[str, ...] = ("labels",)


class EvalHooks(Protocol):
    """What an `EvalLoop` asks of its caller, the one seam between evaluation and the Trainer (the Trainer's
    side: `train/hooks.py` `TrainerEvalHooks`).

    Attributes:
        own_step: the caller computes each batch's (batch-mean loss, logits, labels) in `prediction_step` (a
            user's `prediction_step` or `compute_loss`): losses are averaged over samples, as Hugging Face's.
        generates: predictions are generated token ids (`generate`), not logits.
    """

    own_step: bool
    generates: bool

    def model_inputs(self, batch: dict) -> dict:
        """A collated batch (on the device) as the model gets it."""

    def prediction_step(self, inputs: dict, loss_only: bool) -> tuple:
        """(batch-mean loss or None, logits, labels) of one batch, when `own_step`."""

    def generate(self, batch: dict) -> tuple[list, list]:
        """(generated tokens, reference answers) per row, when `generates` (every rank: FSDP gathers)."""

    def preprocess(self, logits: Any, labels: Any) -> Any:
        """Hugging Face's `preprocess_logits_for_metrics` (or the logits as they are)."""

    def batch_done(self, steps: int | None) -> None:
        """After each batch (`steps`: the batches of this evaluation, None when unknown)."""


class EvalLoop:
    """Evaluates the loader it is given; a `ShareLoader` (data-parallel rank r's block of the dataset, as many
    batches on every rank) gives the exact token-weighted loss and predictions in dataset order.

    Under context parallelism the ranks of a cp group evaluate the same block, each its part of every sequence;
    losses add up over the `loss` mesh, and logits are gathered back to full length before predictions are
    collected (by one rank of each group of ranks that share their samples: cp and tp).
    """

    def __init__(self, runtime: Runtime, model: nn.Module, loss: LossComputer, settings: EvalSettings,
                 hooks: EvalHooks, pipeline: Pipeline | None = None) -> None:
        self.model, self.loss, self.hooks = model, loss, hooks
        self.batch_size = settings.per_device_batch_size * runtime.backend.devices_per_process
        self.dp_rank, self.dp_size, self.device = runtime.dp_rank, runtime.dims.batch_size, runtime.device
        self.cp, self.tp = runtime.cp, runtime.dims.tp
        self.loss_group = runtime.meshes.loss.get_group()  # where (loss sum, token count) add up
        self.collects = runtime.collects_predictions  # one rank per cp x tp group contributes predictions
        self.backend = runtime.backend  # its all_reduce and step_end (XLA runs a graph)
        # batch_metrics: compute_metrics(EvalPrediction, compute_result) on each batch of every rank, gathered;
        # keep_predictions False: none are kept (Hugging Face's evaluate() under batch_eval_metrics)
        self.batch_metrics, self.keep_predictions = settings.batch_metrics, settings.keep_predictions
        # include_for_metrics ["inputs"]: this batch key's rows go to EvalPrediction.inputs (None: no inputs)
        self.inputs_key = settings.inputs_key
        self.label_names = settings.label_names  # several: label_ids is a tuple of arrays, as Hugging Face's
        self.rows = 0  # real rows this rank evaluated
        self.pipeline = pipeline  # pp > 1: forwards run through the stages; the last one holds losses and logits

    def evaluate(self, loader: Any, prefix: str, compute_metrics: Callable | None,
                 with_predictions: bool) -> tuple[PredictionOutput, int]:
        """Evaluate the batches of `loader`, with Hugging Face's speed metrics under `prefix`: a `ShareLoader`'s
        (this rank's share of a dataset or a stream, predictions put back in dataset order), or any other
        loader's (an overridden `get_eval_dataloader`'s: this rank's batches, gathered in rank order).

        Returns:
            the output and the number of samples evaluated (over every data-parallel rank).
        """
        start, global_batch = time.time(), self.batch_size * self.dp_size
        if not isinstance(loader, ShareLoader):
            if self.cp is not None or self.tp > 1:
                raise TrainingArgumentsError(
                    "an overridden get_eval_dataloader/get_test_dataloader returned its own DataLoader while cp_size "
                    "or tp_size > 1, whose ranks must evaluate the same samples; return super().get_eval_dataloader("
                    "...) (shardtrain's split of the dataset), or evaluate with cp_size and tp_size 1")
            batches, steps = self._foreign(loader)
        elif loader.stream:
            if self.batch_metrics:
                raise DataError("batch_eval_metrics with a stream as the evaluation dataset: its last batch is "
                                "known only after it; evaluate a map-style dataset, or set batch_eval_metrics=False")
            batches, steps = self._until_every_rank_is_done(loader.indexed(pad=True)), None
        else:
            batches, steps = loader.indexed(), len(loader)
        output = self._evaluate(batches, steps, prefix, compute_metrics, with_predictions)
        if not isinstance(loader, ShareLoader):
            samples, speed_steps = (steps * global_batch, steps) if steps is not None else \
                (self.rows, -(-self.rows // global_batch))  # a loader without a length: the rows it gave
        else:  # a stream's count is known at its end
            samples = loader.samples if not loader.stream else over_data_ranks(
                self.rows, self.backend.all_reduce, self.device, self.dp_size, self.backend.world_size)
            speed_steps = -(-samples // global_batch)
        output.metrics.update(speed_metrics(prefix, start, num_samples=samples, num_steps=speed_steps))
        if not isinstance(loader, ShareLoader):  # the rows another loader gave (counted where predictions are kept)
            samples = len(output.predictions) if output.predictions is not None else 0
        return output, samples

    def _until_every_rank_is_done(self, batches: Iterator[tuple[list[int], dict]]
                                  ) -> Iterator[tuple[list[int], dict]]:
        """A stream's batches until no rank has a real row left (a rank that ran out first evaluates placeholder
        batches meanwhile, so every rank runs the same forward passes)."""
        for indices, batch in batches:
            count = torch.tensor([float(sum(i >= 0 for i in indices))], dtype=torch.float64, device=self.device)
            self.backend.all_reduce(count)
            if count.item() == 0:
                return
            yield indices, batch.collate() if isinstance(batch, PendingBatch) else batch

    def _foreign(self, loader: Any) -> tuple[Iterator[tuple[list[int], dict]], int]:
        """The batches of a loader that is not shardtrain's: they are this rank's; a rank with fewer batches than
        another repeats its last one with every label ignored, so every rank runs the same forward passes."""
        try:
            length = len(loader)
        except TypeError:  # a loader over an iterable dataset (TRL's over an IterableDataset): its length is unknown
            length = None
        counts = per_rank(length)
        if None in counts:
            if len(counts) > 1:
                raise DataError("an overridden get_eval_dataloader returned a loader without a length on several "
                                "ranks, which must run the same forward passes; return super().get_eval_dataloader("
                                "...) (shardtrain's split of a dataset or a stream), or a loader with a length")
            return (([0] * batch_rows(batch), batch) for batch in loader), None
        steps = max(counts)

        def batches() -> Iterator[tuple[list[int], dict]]:
            last = None
            for batch in loader:
                last = batch
                yield [0] * batch_rows(batch), batch
            for _ in range(steps - counts[collectives.get_rank()]):
                if last is None:
                    raise DataError("the evaluation dataloader of this rank is empty while others have batches; "
                                    "give every rank at least one batch")
                yield [-1] * batch_rows(last), (last if not isinstance(last, dict) else
                                                {k: _ignored(v) if k == "labels" else v for k, v in last.items()})
        return batches(), steps

    def _evaluate(self, batches: Iterator[tuple[list[int], dict]], steps: int | None, prefix: str,
                  compute_metrics: Callable | None, with_predictions: bool) -> PredictionOutput:
        """Run `batches` ((dataset positions, -1 for a placeholder row; collated batch) each; `steps` of them,
        None: not known ahead) and reduce the loss, gather the predictions in position order, run the metrics."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        preds: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        input_rows: list[np.ndarray] = []  # include_for_metrics ['inputs']
        # each collected row's sort key: (place in the dataset, batch, row); a stream's rows arrive strided
        keys: list[tuple[int, int, int]] = []
        batch_result: dict | None = None  # batch_eval_metrics: what compute_metrics returned last
        # left in eval mode, as Hugging Face's evaluation_loop: a library's log() after evaluate() reads
        # model.training to tell evaluation metrics from training ones (TRL), and training_step calls model.train()
        self.model.eval()
        with torch.no_grad():
            for step, (indices, collated) in enumerate(batches):
                seen = len(preds), len(labels), len(input_rows)
                # a library's batch that is not a dict (GRPO's list of prompts) goes to its own prediction_step
                batch = self.backend.to_device(collated) if isinstance(collated, Mapping) else collated
                inputs = self.hooks.model_inputs(batch) if isinstance(batch, Mapping) else batch
                real = sum(i >= 0 for i in indices)  # placeholders (index -1) are at the end
                returned: Any = _NOT_RETURNED  # the labels a prediction_step returns stand for the batch's
                if self.hooks.own_step:
                    loss, logits, returned = self.hooks.prediction_step(inputs, not with_predictions)
                    if loss is not None:
                        totals[0] += loss.double() * real
                        totals[1] += real
                elif self.pipeline is not None:
                    loss_sum, logits = self._through_pipeline(inputs, labelled="labels" in batch)
                    totals[0] += loss_sum.double()
                    if "labels" in batch and self.pipeline.split.is_last:
                        totals[1] += self.loss.items(inputs).double()
                elif "labels" in batch:
                    own = self.loss.uses_model_loss(inputs)
                    if own and 0 < real < len(indices):  # the model's mean loss: over real samples only
                        inputs = _first_rows(inputs, real)
                    with self.loss.running(EVAL_PLACEHOLDER if own and real == 0 else None):
                        # the logits only when predictions are collected from them (else a chunked loss may run)
                        loss_sum, logits = self.loss.forward(inputs, keep_logits=with_predictions
                                                             and not self.hooks.generates)
                        totals[0] += loss_sum.double()
                        totals[1] += self.loss.items(inputs).double()
                else:  # predict() on data without labels: predictions only, no loss
                    logits = self.loss.logits(inputs)
                if with_predictions and self.hooks.generates:
                    generated, answers = self.hooks.generate(batch)  # every rank: FSDP's gathers need all of them
                    if self.collects:
                        self._collect_generated(indices, generated, answers, preds, labels)
                        keys += [(i, 0, 0) for i in indices if i >= 0]
                    logits = None
                if self.cp is not None and logits is not None and with_predictions:
                    logits = self.cp.gather_sequence(logits, inputs[SHARD_KWARG])
                if with_predictions and logits is not None and self.collects:
                    batch_labels = self._batch_labels(batch) if returned is _NOT_RETURNED or self.cp is not None \
                        else returned  # (under cp a prediction_step's labels are this rank's part)
                    keys += self._collect(indices, batch, logits, batch_labels, preds, labels, step,
                                          cut_padding=returned is _NOT_RETURNED)
                if with_predictions and self.inputs_key is not None and self.collects:
                    input_rows += _rows(indices, batch, batch[self.inputs_key])
                if self.batch_metrics and compute_metrics is not None and with_predictions:
                    batch_result = self._batch_metrics(preds, labels, input_rows, seen, compute_metrics,
                                                       step == steps - 1) or batch_result
                self.backend.step_end()
                self.hooks.batch_done(steps)
                self.rows += real
        reshard_all(self.model)
        self.backend.all_reduce(totals, group=self.loss_group)
        metrics = {f"{prefix}_loss": (totals[0] / totals[1]).item()} if totals[1] > 0 else {}
        predictions = label_ids = None
        if with_predictions:
            gathered = per_rank((preds, labels, input_rows, keys))
            every_key = [key for *_, rank_keys in gathered for key in rank_keys]
            order = sorted(range(len(every_key)), key=every_key.__getitem__)  # stable: ties keep rank order

            def in_order(part: int) -> list[np.ndarray]:
                rows = [row for ranks in gathered for row in ranks[part]]
                return [rows[i] for i in order] if len(rows) == len(order) else rows

            predictions = _stack_padded(in_order(0))
            label_ids = _stack_padded(in_order(1)) if any(ranks[1] for ranks in gathered) else None
            all_inputs = _stack_padded(in_order(2)) if self.inputs_key is not None else None
            if self.batch_metrics:
                extra = batch_result or {}
            elif compute_metrics is not None and label_ids is not None:  # as Hugging Face: no labels, no metrics
                extra = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids,
                                                       inputs=all_inputs))
            else:
                extra = {}
            metrics.update({k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": float(v) for k, v in extra.items()})
            if not self.keep_predictions:
                predictions = label_ids = None
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)

    def _through_pipeline(self, inputs: dict[str, Any], labelled: bool) -> tuple[torch.Tensor, Any]:
        """(loss sum, logits) of a forward over the pipeline's stages: the last stage's; 0 and None elsewhere."""
        batch = {k: v for k, v in inputs.items() if k not in LABEL_KEYS}
        return self.pipeline.evaluate(batch, self.loss.targets(inputs) if labelled else None)

    def _batch_metrics(self, preds: list, labels: list, inputs: list, seen: tuple[int, int, int],
                       compute_metrics: Callable, last: bool) -> dict | None:
        """Hugging Face's batch_eval_metrics: compute_metrics on this step's rows of every rank (gathered, in rank
        order, as tensors); the rows are dropped afterwards unless predictions are kept."""
        mine = (preds[seen[0]:], labels[seen[1]:], inputs[seen[2]:])
        if not self.keep_predictions:
            del preds[seen[0]:], labels[seen[1]:], inputs[seen[2]:]
        gathered = collectives.gather_objects(mine)
        step_preds = [p for rank_preds, _, _ in gathered for p in rank_preds]
        step_labels = [label for _, rank_labels, _ in gathered for label in rank_labels]
        step_inputs = [row for *_, rank_inputs in gathered for row in rank_inputs]
        if not step_preds or not step_labels:
            return None
        return compute_metrics(EvalPrediction(predictions=_tensors(_stack_padded(step_preds)),
                                              label_ids=_tensors(_stack_padded(step_labels)),
                                              inputs=_tensors(_stack_padded(step_inputs))
                                              if self.inputs_key is not None else None),
                               compute_result=last)

    @staticmethod
    def _collect_generated(indices: list[int], generated: list, answers: list, preds: list, labels: list) -> None:
        for row, index in enumerate(indices):
            if index >= 0:
                preds.append(np.asarray(generated[row], dtype=np.int64))
                labels.append(np.asarray(answers[row], dtype=np.int64))

    def _batch_labels(self, batch: Any) -> Any:
        """The batch's labels under `label_names` (a tuple when there are several), None without any."""
        names = [name for name in self.label_names if isinstance(batch, Mapping) and batch.get(name) is not None]
        return (batch[names[0]] if len(names) == 1 else tuple(batch[n] for n in names)) if names else None

    def _collect(self, indices: list[int], batch: Any, logits: Any, batch_labels: Any, preds: list,
                 labels: list, step: int, cut_padding: bool = True) -> list[tuple[int, int, int]]:
        """This batch's real rows of `logits` (a tensor, or a tuple of them: one per output) and of
        `batch_labels` (a tuple of several, or `()`: a prediction_step's "labels, none named", as Hugging
        Face's `label_names = []`), padding cut off per-token rows (`cut_padding`: the engine's own rows; what a
        prediction_step returns is kept as it is, as Hugging Face keeps it); returns their sort keys.

        A library's prediction_step may return k rows per sample (TRL's DPO: the chosen rows, then the rejected
        ones): row r then belongs to sample r mod batch size, and the rows keep the batch's order, as under
        Hugging Face."""
        first = logits[0] if isinstance(logits, tuple) else logits
        samples, count = len(indices), first.shape[0] if first.dim() else 1
        blocks = count // samples if samples and count % samples == 0 else 0
        # (batch, tokens, ...) with one row per sample: cut off each row's padding
        per_token = cut_padding and blocks == 1 and first.dim() > 2 and isinstance(batch, Mapping) and \
            "attention_mask" in batch
        logits = self.hooks.preprocess(logits, batch_labels)

        def rows(values: Any) -> Any:  # per row: an array, or a tuple of arrays
            if isinstance(values, tuple | list):
                return list(zip(*(rows(v) for v in values), strict=True)) if values else [()] * count
            values = (values.float() if values.is_floating_point() else values).cpu().numpy()
            if values.ndim == 0:
                return [values]
            return [values[row, :lengths[row]] if lengths is not None else values[row] for row in range(len(values))]

        lengths = batch["attention_mask"].sum(-1).tolist() if per_token else None
        pred_rows = rows(logits)
        label_rows = rows(batch_labels) if batch_labels is not None else None
        if not blocks:  # rows that belong to no one sample: the batch's, whole, unless it is all placeholders
            keep = range(count) if any(i >= 0 for i in indices) else range(0)
            first_place = next((i for i in indices if i >= 0), 0)
            keys = [(first_place, step, row) for row in keep]
        elif blocks == 1:
            keep = [row for row, index in enumerate(indices) if index >= 0]
            keys = [(indices[row], 0, 0) for row in keep]
        else:
            keep = [row for row in range(count) if indices[row % samples] >= 0]
            first_place = next((i for i in indices if i >= 0), 0)
            keys = [(first_place, step, row) for row in keep]
        for row in keep:
            preds.append(pred_rows[row])
            if label_rows is not None and row < len(label_rows):
                labels.append(label_rows[row])
        return keys
