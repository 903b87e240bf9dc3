"""Evaluation over a dataset split across ranks: exact token-weighted loss, gathered predictions."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Sampler
from transformers import EvalPrediction
from transformers.trainer_utils import PredictionOutput, speed_metrics

from shardtrain.errors import DataError
from shardtrain.model_facts import IGNORE_INDEX
from shardtrain.parallel.context import SHARD_KWARG
from shardtrain.parallel.fsdp import reshard_all
from shardtrain.parallel.runtime import Runtime
from shardtrain.train.data.batch_plan import (
    CollatingDataset,
    PlaceholderDataset,
    SeededIndices,
    derive_seed,
    isolated_rng,
    passthrough,
)
from shardtrain.train.data.streaming import is_stream
from shardtrain.train.data.validation import over_data_ranks, per_rank
from shardtrain.train.step.loss import LossComputer, batch_rows


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


class EvalLoop:
    """Data-parallel rank r evaluates the r-th contiguous block of the dataset; short blocks get ignored
    placeholders so every rank runs the same number of forward passes (FSDP's collectives need that).

    Under context parallelism the ranks of a cp group evaluate the same block, each its part of every sequence;
    losses add up over the `loss` mesh, and logits are gathered back to full length before predictions are
    collected (by one rank of each group of ranks that share their samples: cp and tp).
    """

    def __init__(self, runtime: Runtime, model: nn.Module, loss: LossComputer, collator: Callable,
                 per_device_batch_size: int, *, preprocess: Callable | None = None, seed: int = 0,
                 on_step: Callable[[int], None] | None = None, prepare: Callable[[dict], dict] | None = None,
                 generate: Callable[[dict], tuple[list, list]] | None = None,
                 prediction_step: Callable[[dict, bool], tuple] | None = None, batch_metrics: bool = False,
                 keep_predictions: bool = True, inputs_key: str | None = None,
                 label_names: tuple[str, ...] = ("labels",), drop_last: bool = False) -> None:
        self.model, self.loss, self.collator = model, loss, collator
        self.batch_size = per_device_batch_size * runtime.backend.devices_per_process
        self.dp_rank, self.dp_size, self.device = runtime.dp_rank, runtime.dims.batch_size, runtime.device
        self.preprocess, self.seed, self.on_step = preprocess, seed, on_step  # on_step: on_prediction_step
        self.cp, self.prepare = runtime.cp, prepare  # prepare: the Trainer's collated batch -> model inputs
        self.loss_group = runtime.meshes.loss.get_group()  # where (loss sum, token count) add up
        self.generate = generate  # predict_with_generate: batch -> (generated tokens, reference answers) per row
        self.collects = runtime.collects_predictions  # one rank per cp x tp group contributes predictions
        self.backend = runtime.backend  # its all_reduce and step_end (XLA runs a graph)
        # a user's prediction_step / compute_loss: (inputs, loss_only) -> (batch-mean loss, logits, labels), and
        # the loss is averaged over samples, as Hugging Face's evaluation_loop does
        self.prediction_step = prediction_step
        # batch_eval_metrics: compute_metrics(EvalPrediction, compute_result) on each batch of every rank, gathered;
        # keep_predictions False: none are kept (Hugging Face's evaluate() under batch_eval_metrics)
        self.batch_metrics, self.keep_predictions = batch_metrics, keep_predictions
        # include_for_metrics ["inputs"]: this batch key's rows go to EvalPrediction.inputs (None: no inputs)
        self.inputs_key = inputs_key
        self.label_names = label_names  # several: label_ids is a tuple of arrays, as Hugging Face's
        self.drop_last = drop_last  # dataloader_drop_last: the samples of whole global batches only
        self.rows = 0  # real rows this rank evaluated

    def evaluate(self, source: Any, prefix: str, compute_metrics: Callable | None,
                 with_predictions: bool) -> tuple[PredictionOutput, int]:
        """Evaluate `source`: a map-style dataset (`run`), a stream (`run_stream`) or a loader that is not
        shardtrain's (`run_loader`), with Hugging Face's speed metrics under `prefix`.

        Returns:
            the output and the number of samples evaluated (over every data-parallel rank).
        """
        start, global_batch = time.time(), self.batch_size * self.dp_size
        if isinstance(source, DataLoader):
            output = self.run_loader(source, prefix, compute_metrics, with_predictions)
            samples, steps = len(source) * global_batch, len(source)
        elif is_stream(source):
            output = self.run_stream(source, prefix, compute_metrics, with_predictions)
            samples = over_data_ranks(self.rows, self.backend.all_reduce, self.device, self.dp_size,
                                      self.backend.world_size)
            steps = -(-samples // global_batch)
        else:
            output = self.run(source, prefix, compute_metrics, with_predictions)
            samples, steps = len(source), -(-len(source) // global_batch)
        output.metrics.update(speed_metrics(prefix, start, num_samples=samples, num_steps=steps))
        return output, samples

    def run(self, dataset: Any, prefix: str, compute_metrics: Callable | None,
            with_predictions: bool) -> PredictionOutput:
        """Evaluate `dataset`: this rank's contiguous block, in batches of `batch_size`, in dataset order."""
        mine = rank_share(len(dataset), dp_rank=self.dp_rank, dp_size=self.dp_size, batch_size=self.batch_size,
                          drop_last=self.drop_last)
        per_rank = -(-len(dataset) // self.dp_size) if not self.drop_last else len(mine)
        steps = max(1, math.ceil(per_rank / self.batch_size))
        mine += [-1] * (steps * self.batch_size - len(mine))
        data = CollatingDataset(dataset, self.collator)

        def batches() -> Iterator[tuple[list[int], dict]]:
            for step in range(steps):
                indices = mine[step * self.batch_size:(step + 1) * self.batch_size]
                # collated under its own seed: a collator that draws random numbers leaves dropout's RNG alone
                yield indices, data.__getitems__(SeededIndices(indices, derive_seed(self.seed, "eval", step,
                                                                                    self.dp_rank)))
        return self._evaluate(batches(), steps, prefix, compute_metrics, with_predictions)

    def run_stream(self, stream: Any, prefix: str, compute_metrics: Callable | None,
                   with_predictions: bool) -> PredictionOutput:
        """Evaluate a stream (no length): every rank reads it and keeps every dp-th element, from its rank on;
        each step takes the next `batch_size` of them on every rank while any rank has one left (a rank with
        none runs an ignored placeholder batch, so every rank runs the same forward passes). Predictions are
        put back in stream order."""
        if self.batch_metrics:
            raise DataError("batch_eval_metrics with a stream as the evaluation dataset: its last batch is known "
                            "only after it; evaluate a map-style dataset, or set batch_eval_metrics=False")

        def batches() -> Iterator[tuple[list[int], dict]]:
            with isolated_rng(derive_seed(self.seed, "eval_stream", self.dp_rank)):
                elements = iter(stream)
                first = next(elements, None)
            if first is None:
                raise DataError("the evaluation stream gave no sample; check that iterating it yields samples")
            placeholder = PlaceholderDataset([first])[-1]  # the first element with every label ignored
            mine = itertools.islice(itertools.chain([first], elements), self.dp_rank, None, self.dp_size)
            for step in itertools.count():
                with isolated_rng(derive_seed(self.seed, "eval", step, self.dp_rank)):
                    items = list(itertools.islice(mine, self.batch_size))
                count = torch.tensor([float(len(items))], dtype=torch.float64, device=self.device)
                self.backend.all_reduce(count)  # every rank stops at the same step
                if count.item() == 0:
                    return
                start = step * self.batch_size * self.dp_size
                indices = [start + i * self.dp_size + self.dp_rank for i in range(len(items))]
                indices += [-1] * (self.batch_size - len(items))
                with isolated_rng(derive_seed(self.seed, "eval", step, self.dp_rank)):
                    yield indices, self.collator(items + [placeholder] * (self.batch_size - len(items)))
        return self._evaluate(batches(), None, prefix, compute_metrics, with_predictions)

    def run_loader(self, loader: Any, prefix: str, compute_metrics: Callable | None,
                   with_predictions: bool) -> PredictionOutput:
        """Evaluate the batches of a loader that is not shardtrain's (an overridden `get_eval_dataloader`): they
        are this rank's; a rank with fewer batches than another repeats its last one with every label ignored,
        so every rank runs the same forward passes. Predictions are gathered in rank order."""
        counts = per_rank(len(loader))
        steps = max(counts)

        def batches() -> Iterator[tuple[list[int], dict]]:
            last = None
            for batch in loader:
                last = batch
                yield [0] * batch_rows(batch), batch
            for _ in range(steps - counts[dist.get_rank()]):
                if last is None:
                    raise DataError("the evaluation dataloader of this rank is empty while others have batches; "
                                    "give every rank at least one batch")
                yield [-1] * batch_rows(last), {k: _ignored(v) if k == "labels" else v for k, v in last.items()}
        return self._evaluate(batches(), steps, prefix, compute_metrics, with_predictions)

    def _evaluate(self, batches: Iterator[tuple[list[int], dict]], steps: int | None, prefix: str,
                  compute_metrics: Callable | None, with_predictions: bool) -> PredictionOutput:
        """Run `batches` ((dataset positions, -1 for a placeholder row; collated batch) each; `steps` of them,
        None: not known ahead) and reduce the loss, gather the predictions in position order, run the metrics."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        preds: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        input_rows: list[np.ndarray] = []  # include_for_metrics ['inputs']
        positions: list[int] = []  # each collected row's place in the dataset (a stream's rows arrive strided)
        batch_result: dict | None = None  # batch_eval_metrics: what compute_metrics returned last
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for step, (indices, collated) in enumerate(batches):
                seen = len(preds), len(labels), len(input_rows)
                batch = self.backend.to_device(collated)
                inputs = self.prepare(batch) if self.prepare is not None else batch
                real = sum(i >= 0 for i in indices)  # placeholders (index -1) are at the end
                if self.prediction_step is not None:
                    loss, logits, _ = self.prediction_step(inputs, not with_predictions)
                    if loss is not None:
                        totals[0] += loss.double() * real
                        totals[1] += real
                elif "labels" in batch:
                    own = self.loss.uses_model_loss(inputs)
                    if own and 0 < real < len(indices):  # the model's mean loss: over real samples only
                        inputs = _first_rows(inputs, real)
                    self.loss.placeholder = own and real == 0
                    # the logits only when predictions are collected from them (else a chunked loss may run)
                    loss_sum, logits = self.loss.forward(inputs, keep_logits=with_predictions
                                                         and self.generate is None)
                    totals[0] += loss_sum.double()
                    totals[1] += self.loss.items(inputs).double()
                    self.loss.placeholder = False
                else:  # predict() on data without labels: predictions only, no loss
                    logits = self.loss.logits(inputs)
                if with_predictions and self.collects:
                    positions += [i for i in indices if i >= 0]
                if with_predictions and self.generate is not None:
                    generated, answers = self.generate(batch)  # every rank: FSDP's gathers need all of them
                    if self.collects:
                        self._collect_generated(indices, generated, answers, preds, labels)
                    logits = None
                if self.cp is not None and logits is not None and with_predictions:
                    logits = self.cp.gather_sequence(logits, inputs[SHARD_KWARG])
                if with_predictions and logits is not None and self.collects:
                    self._collect(indices, batch, logits, preds, labels)
                if with_predictions and self.inputs_key is not None and self.collects:
                    input_rows += _rows(indices, batch, batch[self.inputs_key])
                if self.batch_metrics and compute_metrics is not None and with_predictions:
                    batch_result = self._batch_metrics(preds, labels, input_rows, seen, compute_metrics,
                                                       step == steps - 1) or batch_result
                self.backend.step_end()
                if self.on_step is not None:
                    self.on_step(steps)
                self.rows += real
        reshard_all(self.model)
        self.model.train(was_training)
        self.backend.all_reduce(totals, group=self.loss_group)
        metrics = {f"{prefix}_loss": (totals[0] / totals[1]).item()} if totals[1] > 0 else {}
        predictions = label_ids = None
        if with_predictions:
            gathered = per_rank((preds, labels, input_rows, positions))
            order = np.argsort([i for *_, rank_positions in gathered for i in rank_positions], kind="stable")

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

    def _batch_metrics(self, preds: list, labels: list, inputs: list, seen: tuple[int, int, int],
                       compute_metrics: Callable, last: bool) -> dict | None:
        """Hugging Face's batch_eval_metrics: compute_metrics on this step's rows of every rank (gathered, in rank
        order, as tensors); the rows are dropped afterwards unless predictions are kept."""
        mine = (preds[seen[0]:], labels[seen[1]:], inputs[seen[2]:])
        if not self.keep_predictions:
            del preds[seen[0]:], labels[seen[1]:], inputs[seen[2]:]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
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

    def _collect(self, indices: list[int], batch: dict, logits: Any, preds: list, labels: list) -> None:
        """This batch's real rows of `logits` (a tensor, or a tuple of them: one per output) and of its labels
        (a tuple when there are several `label_names`), padding cut off per-token rows."""
        names = [name for name in self.label_names if batch.get(name) is not None]
        batch_labels = (batch[names[0]] if len(names) == 1 else tuple(batch[n] for n in names)) if names else None
        first = logits[0] if isinstance(logits, tuple) else logits
        per_token = first.dim() > 2 and "attention_mask" in batch  # (batch, tokens, ...): cut off the padding
        if self.preprocess is not None:
            logits = self.preprocess(logits, batch_labels)

        def rows(values: Any) -> Any:  # per row: an array, or a tuple of arrays
            if isinstance(values, tuple | list):
                return list(zip(*(rows(v) for v in values), strict=True))
            values = (values.float() if values.is_floating_point() else values).cpu().numpy()
            return [values[row, :lengths[row]] if lengths is not None else values[row] for row in range(len(values))]

        lengths = batch["attention_mask"].sum(-1).tolist() if per_token else None
        pred_rows = rows(logits)
        label_rows = rows(batch_labels) if batch_labels is not None else None
        for row, index in enumerate(indices):
            if index < 0:
                continue
            preds.append(pred_rows[row])
            if label_rows is not None:
                labels.append(label_rows[row])


SHARED_DATASET = "_shardtrain_dataset"  # on shardtrain's evaluation loaders: the dataset they split over ranks


def rank_share(length: int, *, dp_rank: int, dp_size: int, batch_size: int, drop_last: bool = False) -> list[int]:
    """The positions of data-parallel rank `dp_rank`'s contiguous block of a dataset of `length` samples;
    `drop_last`: of the samples of whole global batches only (Hugging Face's dataloader_drop_last)."""
    if drop_last:
        length = length // (batch_size * dp_size) * (batch_size * dp_size)
    per_rank = -(-length // dp_size)
    return list(range(dp_rank * per_rank, min(length, (dp_rank + 1) * per_rank)))


def eval_loader(dataset: Any, collator: Callable, *, batch_size: int, dp_rank: int, dp_size: int,
                seed: int, drop_last: bool = False) -> DataLoader:
    """`get_eval_dataloader`'s loader: this data-parallel rank's contiguous share of `dataset`, collated (a stream:
    every element). It stands for its dataset: `loader_source` gives the dataset back, which `EvalLoop.evaluate`
    evaluates exactly over every rank."""
    if is_stream(dataset):  # read by EvalLoop.run_stream; iterating this loader gives every element
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collator)
    else:
        indices = rank_share(len(dataset), dp_rank=dp_rank, dp_size=dp_size, batch_size=batch_size,
                             drop_last=drop_last)
        batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
        loader = DataLoader(CollatingDataset(dataset, collator), batch_sampler=_FixedBatches(batches, seed),
                            collate_fn=passthrough)
    setattr(loader, SHARED_DATASET, dataset)
    loader.total_batch_size = batch_size * dp_size  # Accelerate's loaders say it (batch x processes)
    return loader


def loader_source(loader: Any) -> Any:
    """The dataset an `eval_loader` stands for; any other loader (an override's) is its own source."""
    return getattr(loader, SHARED_DATASET, loader)


class _FixedBatches(Sampler):
    """A batch sampler over fixed index lists (each with its own collation seed)."""

    def __init__(self, batches: list[list[int]], seed: int) -> None:
        self.batches, self.seed = batches, seed

    def __iter__(self) -> Iterator[SeededIndices]:
        for i, batch in enumerate(self.batches):
            yield SeededIndices(batch, derive_seed(self.seed, "share", i))

    def __len__(self) -> int:
        return len(self.batches)
