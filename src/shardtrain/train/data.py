"""Resumable distributed batching whose global batches do not depend on how they are split.

Each epoch has one seeded permutation of the dataset. Step `s` uses the contiguous global chunk
`perm[s*G:(s+1)*G]` (G = per-device batch x accumulation x data-parallel ranks); micro-step `m` of that chunk
goes to ranks in contiguous slices. So 1 rank x 8, 2 ranks x 4 and 2 ranks x 2 x accumulation 2 see the same
samples at every step, and a resume (on any world size with the same G) starts at exactly the next step.
Nothing is dropped: where the last chunk runs short a rank gets a placeholder sample (index < 0) whose labels
are all ignored, so every rank runs the same number of forward passes.

Randomness in data loading never touches the training RNG: each micro-batch is fetched and collated under
its own RNG state, seeded from (seed, epoch, step, micro-step, rank), and the global generators are put
back afterwards. So dropout draws the same numbers whether or not a run was resumed, and a collator or
dataset that draws random numbers (masking, augmentation) gives the same batch at a step after a resume, in
the main process or in a DataLoader worker.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

IGNORE_INDEX = -100


@dataclass(kw_only=True, frozen=True)
class BatchPlan:
    """How the dataset is cut into global batches, micro-batches and per-rank slices."""

    num_samples: int
    per_device_batch_size: int
    accumulation_steps: int
    world_size: int
    rank: int
    seed: int
    shuffle: bool = True

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.accumulation_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.num_samples / self.global_batch_size))

    def permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def micro_batches(self, perm: Sequence[int], step: int, epoch: int = 0) -> list[SeededIndices]:
        """This rank's `accumulation_steps` index lists for `step` (placeholders are < 0), each with its seed."""
        chunk = perm[step * self.global_batch_size:(step + 1) * self.global_batch_size]
        per_micro = self.per_device_batch_size * self.world_size
        out = []
        for micro in range(self.accumulation_steps):
            start = micro * per_micro + self.rank * self.per_device_batch_size
            indices = list(chunk[start:start + self.per_device_batch_size])
            out.append(SeededIndices(indices or [-1], seed=derive_seed(self.seed, "train", epoch, step, micro,
                                                                       self.rank)))
        return out


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed that depends on `parts` only (stable across processes and Python versions)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededIndices(list):
    """The sample indices of one micro-batch, with the seed its loading and collation run under."""

    def __init__(self, indices: Sequence[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self):  # DataLoader workers receive index lists through a pickling queue
        return SeededIndices, (list(self), self.seed)


@contextlib.contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Run the body with torch (CPU), Python and NumPy generators seeded from `seed`; restore them after."""
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


class StepBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batch index lists from (epoch, step) onwards, `accumulation_steps` per step."""

    def __init__(self, plan: BatchPlan, epoch: int, start_step: int = 0) -> None:
        self.plan, self.epoch, self.start_step = plan, epoch, start_step

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.plan.permutation(self.epoch)
        for step in range(self.start_step, self.plan.steps_per_epoch):
            yield from self.plan.micro_batches(perm, step, self.epoch)

    def __len__(self) -> int:
        return (self.plan.steps_per_epoch - self.start_step) * self.plan.accumulation_steps


class PlaceholderDataset(Dataset):
    """The user's dataset, plus index < 0 meaning "sample 0 with every label ignored"."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index >= 0:
            return self.dataset[index]
        item = dict(self.dataset[0])
        labels = item.get("labels", item["input_ids"])
        item["labels"] = _ignored_like(labels)
        return item


class CollatingDataset(PlaceholderDataset):
    """Fetches and collates a whole micro-batch under the micro-batch's own seed (`isolated_rng`).

    The DataLoader hands `__getitems__` a `SeededIndices`; its collate_fn is `passthrough`.
    """

    def __init__(self, dataset: Any, collator: Callable) -> None:
        super().__init__(dataset)
        self.collator = collator

    def __getitems__(self, indices: SeededIndices) -> Any:
        with isolated_rng(indices.seed):
            return self.collator([self[i] for i in indices])


def passthrough(batch: Any) -> Any:
    """collate_fn for `CollatingDataset` (already collated); module-level so workers can pickle it."""
    return batch


def _ignored_like(labels: Any) -> Any:
    if isinstance(labels, torch.Tensor):
        return torch.full_like(labels, IGNORE_INDEX)
    if isinstance(labels, list | tuple):
        return [IGNORE_INDEX] * len(labels)
    return IGNORE_INDEX


def _as_list(value: Any) -> list:
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


@dataclass
class PaddingCollator:
    """Pads `input_ids` (with `pad_token_id`), `labels` (with -100) and `attention_mask` (with 0) to the
    longest sample; `labels` default to `input_ids` (padding ignored). Scalar labels stay a 1-D tensor;
    other keys are stacked as tensors."""

    pad_token_id: int = 0

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        stacked = _stack_equal_length(items)
        if stacked is not None:
            return stacked
        longest = max(len(_as_list(item["input_ids"])) for item in items)
        batch: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
        scalar_labels = False
        for item in items:
            ids = _as_list(item["input_ids"])
            pad = longest - len(ids)
            mask = _as_list(item["attention_mask"]) if "attention_mask" in item else [1] * len(ids)
            labels = item.get("labels", ids)
            batch["input_ids"].append(ids + [self.pad_token_id] * pad)
            batch["attention_mask"].append(mask + [0] * pad)
            if isinstance(labels, int) or (isinstance(labels, torch.Tensor) and labels.dim() == 0):
                scalar_labels = True
                batch["labels"].append(int(labels))
            else:
                batch["labels"].append(_as_list(labels) + [IGNORE_INDEX] * pad)
        out = {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
        for key in items[0]:
            if key not in out:
                out[key] = torch.stack([torch.as_tensor(item[key]) for item in items])
        if scalar_labels:
            out["labels"] = out["labels"].view(-1)
        return out


_TOKEN_KEYS = ("input_ids", "attention_mask", "labels")


def _stack_equal_length(items: list[dict[str, Any]]) -> dict[str, torch.Tensor] | None:
    """The batch when every token field is already a 1-D tensor of one length (nothing to pad); else None."""
    keys = items[0].keys()
    length = None
    for item in items:
        if item.keys() != keys:
            return None
        for key in _TOKEN_KEYS:
            value = item.get(key)
            if value is None and key != "input_ids":
                continue
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != torch.long:
                return None
            length = value.shape[0] if length is None else length
            if value.shape[0] != length:
                return None
    out = {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in keys}
    if "attention_mask" not in out:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    if "labels" not in out:
        out["labels"] = out["input_ids"].clone()
    return out
