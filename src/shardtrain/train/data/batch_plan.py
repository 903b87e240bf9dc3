"""Resumable distributed batching whose global batches do not depend on how they are split.

Each epoch has one seeded permutation of the dataset (or the order a sampler gives: an overridden
`Trainer._get_train_sampler`, `train_sampling_strategy="sequential"`; the same on every rank). Step `s` uses
the contiguous global chunk `perm[s*G:(s+1)*G]` (G = per-device batch x accumulation x data-parallel ranks;
the context-parallel ranks of one group load the same samples and split each sequence); micro-step `m` of
that chunk goes to ranks in contiguous slices. So 1 rank x 8, 2 ranks x 4 and 2 ranks x 2 x accumulation 2 see the same
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

from shardtrain.model_facts import IGNORE_INDEX, LABEL_COLUMNS, base_model


@dataclass(kw_only=True, frozen=True)
class BatchPlan:
    """How the dataset is cut into global batches, micro-batches and per-rank slices."""

    num_samples: int
    per_device_batch_size: int
    accumulation_steps: int
    dp_size: int  # ranks that see different samples (the `batch` mesh); context-parallel ranks share theirs
    dp_rank: int
    seed: int
    order: EpochOrder | None = None  # the epochs' orders from a sampler; None: a seeded permutation per epoch
    drop_last: bool = False  # dataloader_drop_last: an epoch's short last global batch is left out

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.accumulation_steps * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return max(1, self.num_samples // self.global_batch_size)
        return max(1, math.ceil(self.num_samples / self.global_batch_size))

    def permutation(self, epoch: int) -> list[int]:
        if self.order is not None:
            return self.order(epoch)
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def micro_batches(self, perm: Sequence[int], step: int, epoch: int = 0) -> list[SeededIndices]:
        """This rank's `accumulation_steps` index lists for `step` (placeholders are < 0), each with its seed."""
        chunk = perm[step * self.global_batch_size:(step + 1) * self.global_batch_size]
        per_micro = self.per_device_batch_size * self.dp_size
        out = []
        for micro in range(self.accumulation_steps):
            start = micro * per_micro + self.dp_rank * self.per_device_batch_size
            indices = list(chunk[start:start + self.per_device_batch_size])
            out.append(SeededIndices(indices or [-1], seed=derive_seed(self.seed, "train", epoch, step, micro,
                                                                       self.dp_rank)))
        return out


class EpochOrder:
    """The global order of each epoch's samples, drawn from a `Sampler` (Hugging Face's `_get_train_sampler`):
    one pass over it per epoch, as a DataLoader iterates it again at each epoch. A sampler with `set_epoch` is
    told the epoch; one that draws from a generator of its own gives the next order at each pass, so the passes
    are replayed in order (and kept) to reach an epoch again, e.g. after a resume."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._orders: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.sampler)

    def __call__(self, epoch: int) -> list[int]:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
            return [int(i) for i in self.sampler]
        while len(self._orders) <= epoch:
            self._orders.append([int(i) for i in self.sampler])
        return self._orders[epoch]


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

    labels_from_input_ids = True

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index >= 0:
            return self.dataset[index]
        item = dict(self.dataset[0])
        labels = _labels_of(item)
        for key in LABEL_KEYS:
            # each label under its own name, as the real rows carry it (a library's collator reads that name);
            # a bool is a flag (TRL's KTO "label": desirable or not), not a target, and stays as it is
            if key in item and not isinstance(item[key], bool):
                item[key] = _ignored_like(item[key])
        if labels is None and self.labels_from_input_ids and "input_ids" in item:  # no labels: none here
            item["labels"] = _ignored_like(item["input_ids"])
        return item


class CollatingDataset(PlaceholderDataset):
    """Fetches and collates a whole micro-batch under the micro-batch's own seed (`isolated_rng`).

    The DataLoader hands `__getitems__` a `SeededIndices`; its collate_fn is `passthrough`.
    """

    def __init__(self, dataset: Any, collator: Callable) -> None:
        super().__init__(dataset)
        self.collator = collator
        self.labels_from_input_ids = getattr(getattr(collator, "collator", collator), "labels_from_input_ids", True)

    def __getitems__(self, indices: SeededIndices) -> Any:
        with isolated_rng(indices.seed):
            return self.collator([self[i] for i in indices])


def passthrough(batch: Any) -> Any:
    """collate_fn for `CollatingDataset` (already collated); module-level so workers can pickle it."""
    return batch


def _ignored_like(labels: Any) -> Any:
    """Labels of the same shape and type, all ignored (-100; -100.0 for float targets, which keep their dtype)."""
    if isinstance(labels, torch.Tensor):
        return torch.full_like(labels, IGNORE_INDEX)
    if isinstance(labels, list | tuple):
        return [_ignored_like(v) for v in labels]
    return float(IGNORE_INDEX) if isinstance(labels, float) else IGNORE_INDEX


def _as_list(value: Any) -> list:
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


LABEL_KEYS = LABEL_COLUMNS


def _labels_of(item: dict[str, Any]) -> Any:
    for key in LABEL_KEYS:
        if key in item:
            return item[key]
    return None


@dataclass
class PaddingCollator:
    """Pads every per-token field to the longest sample: `input_ids` with `pad_token_id`, `labels` with -100 (to
    the longest labels: an encoder-decoder's targets have their own length), other token fields
    (`attention_mask`, `token_type_ids`, ...) with 0. `label` / `label_ids` become `labels`; without any, `labels`
    are the `input_ids` (padding ignored). Scalar labels stay a 1-D tensor; other fields are stacked as tensors."""

    pad_token_id: int = 0
    labels_from_input_ids: bool = True  # causal LMs: no labels means "predict every next token"

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "input_ids" not in items[0]:  # features, pixels, audio, embeddings: Hugging Face's default collator
            from transformers import default_data_collator

            return default_data_collator(items)
        stacked = _stack_equal_length(items, self.labels_from_input_ids)
        if stacked is not None:
            return stacked
        lengths = [len(_as_list(item["input_ids"])) for item in items]
        longest = max(lengths)
        token_keys = [k for k in items[0] if k not in (*LABEL_KEYS, "input_ids") and _is_token_field(items, k, lengths)]
        out: dict[str, torch.Tensor] = {}
        out["input_ids"] = torch.tensor([_as_list(i["input_ids"]) + [self.pad_token_id] * (longest - n)
                                         for i, n in zip(items, lengths, strict=True)], dtype=torch.long)
        for key in token_keys:
            out[key] = torch.tensor([_as_list(i[key]) + [0] * (longest - n)
                                     for i, n in zip(items, lengths, strict=True)])
        if "attention_mask" not in out:
            out["attention_mask"] = torch.tensor([[1] * n + [0] * (longest - n) for n in lengths], dtype=torch.long)
        labels = [_labels_of(item) for item in items]
        if all(v is None for v in labels) and not self.labels_from_input_ids:
            pass
        elif all(isinstance(v, int | float) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in labels):
            out["labels"] = torch.tensor([v.item() if isinstance(v, torch.Tensor) else v for v in labels])
        elif all(_is_float_vector(v) for v in labels):  # one target vector per sample (multi-label, regression)
            out["labels"] = torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in labels])
        else:
            rows = [_as_list(i["input_ids"]) if v is None else _as_list(v) for i, v in zip(items, labels, strict=True)]
            # per-token labels are as long as their input_ids; an encoder-decoder's target has its own length
            width = max(len(row) for row in rows)
            out["labels"] = torch.tensor([row + [IGNORE_INDEX] * (width - len(row)) for row in rows],
                                         dtype=torch.long)
        for key in items[0]:
            if key not in out and key not in LABEL_KEYS:
                out[key] = torch.stack([torch.as_tensor(item[key]) for item in items])
        return out


def _is_float_vector(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, float) for v in value)


def _is_token_field(items: list[dict[str, Any]], key: str, lengths: list[int]) -> bool:
    """Whether `key` holds one value per token (a sequence as long as `input_ids`) in every item."""
    for item, length in zip(items, lengths, strict=True):
        value = item[key]
        if isinstance(value, str) or not hasattr(value, "__len__") or len(value) != length:
            return False
        if isinstance(value, torch.Tensor) and value.dim() != 1:
            return False
    return True


_TOKEN_KEYS = ("input_ids", "attention_mask", "labels")


def _stack_equal_length(items: list[dict[str, Any]], labels_from_input_ids: bool) -> dict[str, torch.Tensor] | None:
    """The batch when every field is already a 1-D long tensor of one length (nothing to pad); else None."""
    keys = items[0].keys()
    if any(k in keys for k in LABEL_KEYS[1:]):
        return None
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
    if "labels" not in out and labels_from_input_ids:
        out["labels"] = out["input_ids"].clone()
    return out


@dataclass
class ColumnFilter:
    """Hugging Face's `remove_unused_columns`: drop the fields the model's forward does not take (label names
    are kept and renamed by the collator), then collate."""

    collator: Any
    keep: frozenset[str]

    def __call__(self, items: list[dict[str, Any]]) -> Any:
        return self.collator([{k: v for k, v in item.items() if k in self.keep} if isinstance(item, dict) else item
                              for item in items])

    def __getattr__(self, name: str) -> Any:
        # the collator's own attributes, as on Hugging Face's `trainer.data_collator` (its `tokenizer`, which
        # transformers saves when there is no processing_class)
        if name in ("collator", "keep"):
            raise AttributeError(name)
        return getattr(self.collator, name)


def forward_columns(model: torch.nn.Module) -> frozenset[str]:
    """The parameter names of `model.forward` plus the label names: what `remove_unused_columns` keeps (as
    Hugging Face, a `**kwargs` parameter does not make every column welcome). A PEFT model forwards to its base
    model, whose signature counts (as Hugging Face does)."""
    import inspect

    from shardtrain.checkpoint.model_state import unwrap  # torch_xla's FSDP forwards *args, **kwargs

    model = unwrap(model)
    base = base_model(model)
    return frozenset(inspect.signature(base.forward).parameters) | frozenset(LABEL_KEYS)
