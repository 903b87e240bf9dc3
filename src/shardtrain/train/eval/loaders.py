"""The evaluation loaders `get_eval_dataloader` and `get_test_dataloader` return: the dataset split over the
data-parallel ranks once, here, and iterated as given by `EvalLoop`.

    loader = ShareLoader(dataset, collator, batch_size=8, dp_rank=1, dp_size=2, seed=42)
    for batch in loader: ...                      # this rank's batches, as any DataLoader
    for positions, batch in loader.indexed(): ... # each row's place in the dataset too (-1: a placeholder row)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler, Subset

from shardtrain.errors import DataError
from shardtrain.train.data.batch_plan import (
    CollatingDataset,
    PlaceholderDataset,
    SeededIndices,
    derive_seed,
    isolated_rng,
    passthrough,
)
from shardtrain.train.data.streaming import is_stream


def rank_share(length: int, *, dp_rank: int, dp_size: int, batch_size: int, drop_last: bool = False) -> list[int]:
    """The positions of data-parallel rank `dp_rank`'s contiguous block of a dataset of `length` samples;
    `drop_last`: of the samples of whole global batches only (Hugging Face's dataloader_drop_last)."""
    if drop_last:
        length = length // (batch_size * dp_size) * (batch_size * dp_size)
    per_rank = -(-length // dp_size)
    return list(range(dp_rank * per_rank, min(length, (dp_rank + 1) * per_rank)))


def in_sampler_order(dataset: Any, sampler: Sampler | None) -> Any:
    """`dataset` in the order `sampler` gives (None: as it is): a `datasets.Dataset` selects, else a `Subset`."""
    if sampler is None:
        return dataset
    indices = [int(i) for i in sampler]
    return dataset.select(indices) if hasattr(dataset, "select") else Subset(dataset, indices)


class ShareLoader(DataLoader):
    """This data-parallel rank's share of an evaluation dataset, batched as every rank evaluates it.

    A map-style dataset: rank r's contiguous block, in dataset order, in as many batches on every rank (a rank
    with a shorter block ends with one-row placeholder batches: sample 0 with every label ignored), so every rank
    runs the same forward passes, which FSDP's collectives need. A stream (no length): every rank reads it and
    keeps every dp-th element from its rank on; a rank that runs out first goes on with placeholder batches in
    `indexed(pad=True)` until every rank has (the evaluation loop agrees on that each step). Each batch is
    collated under its own seed, so a collator that draws random numbers leaves dropout's RNG alone.

    Attributes:
        samples: the samples evaluated over every rank (None for a stream: known at its end).
        total_batch_size: the batch size times the data-parallel ranks (Accelerate's loaders say it).
    """

    def __init__(self, dataset: Any, collator: Callable, *, batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, drop_last: bool = False) -> None:
        self.stream = is_stream(dataset)
        if self.stream:
            super().__init__(_StreamShare(dataset, collator, batch_size=batch_size, dp_rank=dp_rank,
                                          dp_size=dp_size, seed=seed), batch_size=None)
            self.samples = None
        else:
            mine = rank_share(len(dataset), dp_rank=dp_rank, dp_size=dp_size, batch_size=batch_size,
                              drop_last=drop_last)
            per_rank = len(mine) if drop_last else -(-len(dataset) // dp_size)
            steps = max(1, -(-per_rank // batch_size))
            # a short last batch stays short, as under Hugging Face: a library's own loss over it (TRL's KTO, with
            # a collator that needs every column) sees real rows only; a rank with fewer batches than the others
            # runs one-row placeholder batches for the collectives
            self.positions = [mine[start:start + batch_size] for start in range(0, len(mine), batch_size)]
            self.positions += [[-1]] * (steps - len(self.positions))
            super().__init__(CollatingDataset(dataset, collator),
                             batch_sampler=_Batches(self.positions, seed, dp_rank), collate_fn=passthrough)
            self.samples = len(dataset)
        self.total_batch_size = batch_size * dp_size

    def indexed(self, *, pad: bool = False) -> Iterator[tuple[list[int], Any]]:
        """(each row's dataset position, -1 for a placeholder; the collated batch) per batch; `pad`: a stream's
        placeholder batches after this rank's last, without end."""
        if self.stream:
            return self.dataset.indexed(pad=pad)
        return zip(self.positions, self, strict=True)


class _Batches(Sampler):
    """Fixed index lists, each with the seed its evaluation step collates under."""

    def __init__(self, batches: list[list[int]], seed: int, dp_rank: int) -> None:
        self.batches, self.seed, self.dp_rank = batches, seed, dp_rank

    def __iter__(self) -> Iterator[SeededIndices]:
        for step, batch in enumerate(self.batches):
            yield SeededIndices(batch, derive_seed(self.seed, "eval", step, self.dp_rank))

    def __len__(self) -> int:
        return len(self.batches)


class PendingBatch:
    """A placeholder batch not collated yet: the evaluation loop collates it (`collate()`) only when another rank
    still has rows, so a library's collator never sees a placeholder the run does not need."""

    def __init__(self, collator: Callable, row: dict[str, Any], seed: int) -> None:
        self.collator, self.row, self.seed = collator, row, seed

    def collate(self) -> Any:
        with isolated_rng(self.seed):
            return self.collator([self.row])


class _StreamShare(IterableDataset):
    """A stream's every dp-th element from `dp_rank` on, in collated batches of `batch_size` (the last one may be
    short; after it, with `pad`, one-row placeholder batches: the stream's first element with every label
    ignored)."""

    def __init__(self, stream: Any, collator: Callable, *, batch_size: int, dp_rank: int, dp_size: int,
                 seed: int) -> None:
        self.stream, self.collator, self.seed = stream, collator, seed
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[Any]:
        return (batch for _, batch in self.indexed())

    def indexed(self, *, pad: bool = False) -> Iterator[tuple[list[int], Any]]:
        with isolated_rng(derive_seed(self.seed, "eval_stream", self.dp_rank)):
            elements = iter(self.stream)
            first = next(elements, None)
        if first is None:
            raise DataError("the evaluation stream gave no sample; check that iterating it yields samples")
        placeholder = PlaceholderDataset([first])[-1]
        mine = itertools.islice(itertools.chain([first], elements), self.dp_rank, None, self.dp_size)
        for step in itertools.count():
            with isolated_rng(derive_seed(self.seed, "eval", step, self.dp_rank)):
                items = list(itertools.islice(mine, self.batch_size))
            if not items and not pad:
                return
            start = step * self.batch_size * self.dp_size
            indices = [start + i * self.dp_size + self.dp_rank for i in range(len(items))]
            if not items:  # this rank ran out: a one-row placeholder batch, collated only if another rank goes on
                yield [-1], PendingBatch(self.collator, placeholder, derive_seed(self.seed, "eval", step, self.dp_rank))
                continue
            with isolated_rng(derive_seed(self.seed, "eval", step, self.dp_rank)):  # a short last batch stays short
                yield indices, self.collator(items)
