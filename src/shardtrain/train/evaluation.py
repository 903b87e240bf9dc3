"""Evaluation over a dataset split across ranks: exact token-weighted loss, gathered predictions."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardtrain.parallel.fsdp import reshard_all
from shardtrain.train.data import IGNORE_INDEX, CollatingDataset, SeededIndices, derive_seed
from shardtrain.train.loss import LossComputer


@dataclass
class EvalPrediction:
    """What `compute_metrics` receives (as in Hugging Face): arrays padded with -100."""

    predictions: np.ndarray
    label_ids: np.ndarray


@dataclass
class PredictionOutput:
    predictions: np.ndarray | None
    label_ids: np.ndarray | None
    metrics: dict[str, float]


def _stack_padded(rows: list[np.ndarray]) -> np.ndarray:
    if not rows:
        return np.zeros((0,))
    if rows[0].ndim == 0 or all(r.shape == rows[0].shape for r in rows):
        return np.stack(rows)
    longest = max(r.shape[0] for r in rows)
    out = np.full((len(rows), longest, *rows[0].shape[1:]), IGNORE_INDEX, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, :row.shape[0]] = row
    return out


class EvalLoop:
    """Rank r evaluates the r-th contiguous block of the dataset; short blocks get ignored placeholders so
    every rank runs the same number of forward passes (FSDP's collectives need that)."""

    def __init__(self, model: nn.Module, loss: LossComputer, collator: Callable, batch_size: int, rank: int,
                 world_size: int, device: torch.device, preprocess: Callable | None, seed: int = 0) -> None:
        self.model, self.loss, self.collator, self.batch_size = model, loss, collator, batch_size
        self.rank, self.world_size, self.device, self.preprocess = rank, world_size, device, preprocess
        self.seed = seed

    def run(self, dataset: Any, prefix: str, compute_metrics: Callable | None,
            with_predictions: bool) -> PredictionOutput:
        per_rank = math.ceil(len(dataset) / self.world_size)
        start = self.rank * per_rank
        mine = list(range(start, min(len(dataset), start + per_rank)))
        steps = max(1, math.ceil(per_rank / self.batch_size))
        mine += [-1] * (steps * self.batch_size - len(mine))
        data = CollatingDataset(dataset, self.collator)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        preds: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for step in range(steps):
                indices = mine[step * self.batch_size:(step + 1) * self.batch_size]
                # collated under its own seed: a collator that draws random numbers leaves dropout's RNG alone
                seeded = SeededIndices(indices, derive_seed(self.seed, "eval", step, self.rank))
                batch = {k: v.to(self.device) for k, v in data.__getitems__(seeded).items()}
                loss_sum, logits = self.loss.forward(batch)
                totals[0] += loss_sum.double()
                totals[1] += self.loss.items(batch["labels"]).double()
                if with_predictions and logits is not None:
                    self._collect(indices, batch, logits, preds, labels)
        reshard_all(self.model)
        self.model.train(was_training)
        dist.all_reduce(totals)
        metrics = {f"{prefix}_loss": (totals[0] / totals[1].clamp(min=1)).item()}
        predictions = label_ids = None
        if with_predictions:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, (preds, labels))
            predictions = _stack_padded([p for rank_preds, _ in gathered for p in rank_preds])
            label_ids = _stack_padded([label for _, rank_labels in gathered for label in rank_labels])
            if compute_metrics is not None:
                extra = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
                metrics.update({k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": float(v)
                                for k, v in extra.items()})
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)

    def _collect(self, indices: list[int], batch: dict, logits: torch.Tensor, preds: list, labels: list) -> None:
        if self.preprocess is not None:
            logits = self.preprocess(logits, batch["labels"])
        logits = logits.float() if logits.is_floating_point() else logits
        logits, batch_labels = logits.cpu().numpy(), batch["labels"].cpu().numpy()
        lengths = batch["attention_mask"].sum(-1).tolist() if "attention_mask" in batch else None
        for row, index in enumerate(indices):
            if index < 0:
                continue
            if batch_labels.ndim > 1 and lengths is not None:
                preds.append(logits[row, :lengths[row]])
                labels.append(batch_labels[row, :lengths[row]])
            else:
                preds.append(logits[row])
                labels.append(batch_labels[row])
