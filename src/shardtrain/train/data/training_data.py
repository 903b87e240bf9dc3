"""The training batches of every step, a part of the Trainer with one job: which plan the data follows and each
step's micro-batches on this rank.

    data = TrainingData(dataset=ds, collator=collate, per_process_batch=8, accumulation_steps=2, dp_size=2,
                        dp_rank=0, seed=42, data_seed=42, world_size=2, all_reduce=dist.all_reduce)
    plan = data.plan(user_loader=None)                   # BatchPlan (map-style), StreamPlan or LoaderPlan
    for batches, placeholders in data.epoch_steps(plan, epoch=0, start=0): ...

Three plans, one interface (`steps_per_epoch`, `global_batch_size`): shardtrain's own `BatchPlan` over a map-style
dataset (the same samples per step on any layout, exact resume on any world size), `StreamPlan` over a stream,
and `LoaderPlan` over the batches of an overridden `get_train_dataloader` (Hugging Face's way; a warning says what
that gives up). A fresh `TrainingData` is made per `train()`, from the Trainer's dataset and collator then.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from shardtrain.errors import DataError
from shardtrain.parallel.collectives import agree, over_data_ranks, per_rank
from shardtrain.parallel.runtime import Runtime
from shardtrain.train.data.batch_plan import (
    BatchPlan,
    CollatingDataset,
    EpochOrder,
    StepBatchSampler,
    derive_seed,
    passthrough,
)
from shardtrain.train.data.streaming import StreamPlan, is_stream
from shardtrain.train.data.user_loader import OVERRIDE_WARNING, LoaderPlan

Plan = BatchPlan | StreamPlan | LoaderPlan


@dataclass(frozen=True, kw_only=True)
class TrainingData:
    """What the training batches are made of (see the module docstring).

    Attributes:
        dataset: the train dataset (map-style or a stream).
        collator: turns a list of samples into a batch.
        per_process_batch: samples per micro-batch of this process (all its devices: XLA SPMD feeds several).
        per_device_batch: `per_device_train_batch_size` (a user's loader's global batch is counted with it).
        accumulation_steps: micro-batches per optimizer step.
        dp_size, dp_rank: the data-parallel ranks (the `batch` mesh) and this one's place among them.
        seed: the run's seed (the loaders' own generators); data_seed: the order of the samples.
        world_size: ranks in the default process group (a stream's global count is over them).
        all_reduce: sums a tensor over every rank in place.
        device: where counts are reduced.
        num_workers, pin_memory, prefetch_factor: the DataLoader's (Hugging Face's `dataloader_*` fields).
        rank: this process's rank (the warning about a user's loader is given once, by rank 0).
    """

    dataset: Any
    collator: Callable
    per_process_batch: int
    per_device_batch: int
    accumulation_steps: int
    dp_size: int
    dp_rank: int
    seed: int
    data_seed: int
    world_size: int
    all_reduce: Callable[[torch.Tensor], None]
    device: torch.device = torch.device("cpu")
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    rank: int = 0
    drop_last: bool = False

    @classmethod
    def of(cls, args: Any, runtime: Runtime, dataset: Any, collator: Callable,
           per_device: int | None = None) -> TrainingData:
        """The part for `TrainingArguments` `args` (batch sizes, accumulation, seeds, `dataloader_*`) on a
        `parallel.runtime.Runtime`. `per_device`: a per-device batch below the configured one (which it divides;
        `auto_find_batch_size`), the accumulation steps grown so that the global batch stays the same (and by the
        spec's `accumulation_factor`: a pipeline an automatic layout chose)."""
        device = runtime.device
        per_device = per_device or args.per_device_train_batch_size
        accumulation = (args.gradient_accumulation_steps * runtime.spec.accumulation_factor
                        * args.per_device_train_batch_size // per_device)
        dp_size, dp_rank = runtime.dims.batch_size, runtime.dp_rank
        if runtime.spec.fault_tolerance is not None:  # replica groups: slices of one global batch
            dp_size, dp_rank = runtime.spec.fault_tolerance.data_split(dp_size, dp_rank)
        return cls(
            dataset=dataset, collator=collator,
            # a process that feeds several devices (XLA SPMD) loads all their batches at once
            per_process_batch=per_device * runtime.backend.devices_per_process,
            per_device_batch=per_device, accumulation_steps=accumulation,
            dp_size=dp_size, dp_rank=dp_rank, seed=args.seed,
            data_seed=args.seed if args.data_seed is None else args.data_seed, world_size=runtime.world_size,
            all_reduce=runtime.backend.all_reduce, device=device, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and device.type == "cuda",
            prefetch_factor=args.dataloader_prefetch_factor, rank=runtime.rank, drop_last=args.dataloader_drop_last)

    def plan(self, user_loader: Callable[[], Any] | None = None, owner: str = "", sampler: Any = None,
             resumed: Callable[[Any, int], Any] | None = None) -> Plan:
        """The plan of the steps: a user's loader's (`user_loader`: an overridden `get_train_dataloader`,
        defined by the class `owner`; called once; `resumed`: an overridden `get_resumed_dataloader`, see
        `LoaderPlan`), a stream's, or shardtrain's own batch plan (over the epochs' orders of `sampler`, Hugging
        Face's `_get_train_sampler`, when it gives one)."""
        if user_loader is not None:
            return self._user_loader_plan(user_loader, owner, resumed)
        if is_stream(self.dataset):
            return StreamPlan(self.dataset, self.collator, self.per_process_batch, self.accumulation_steps,
                              dp_size=self.dp_size, dp_rank=self.dp_rank, seed=self.data_seed,
                              global_count=self._global_sample_count)
        order = EpochOrder(sampler) if sampler is not None else None
        return BatchPlan(num_samples=len(order if order is not None else self.dataset),
                         per_device_batch_size=self.per_process_batch, accumulation_steps=self.accumulation_steps,
                         dp_size=self.dp_size, dp_rank=self.dp_rank, seed=self.data_seed, order=order,
                         drop_last=self.drop_last)

    def loader(self, plan: BatchPlan | StreamPlan, epoch: int, start_step: int) -> DataLoader:
        """This rank's micro-batches of `epoch` from `start_step` on, as a DataLoader (over a stream: an iterable
        one, whose reading is collective, as the training loop's)."""
        if isinstance(plan, StreamPlan):
            loader = DataLoader(_StreamMicroBatches(plan, epoch, start_step), batch_size=None)
            loader.total_batch_size = self.per_device_batch * self.dp_size
            return loader
        # Its own generator: creating the iterator must not draw from the global RNG that dropout uses, or a
        # resumed run (which creates one more iterator) would drop out different units.
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "loader", epoch, self.dp_rank))
        loader = DataLoader(CollatingDataset(self.dataset, self.collator),
                            batch_sampler=StepBatchSampler(plan, epoch, start_step), collate_fn=passthrough,
                            num_workers=self.num_workers, generator=generator, pin_memory=self.pin_memory,
                            prefetch_factor=self.prefetch_factor if self.num_workers else None)
        loader.total_batch_size = self.per_device_batch * self.dp_size  # Accelerate's loaders say it
        return loader

    def epoch_steps(self, plan: Plan, epoch: int, start: int) -> Iterator[tuple[list[dict[str, Any]], list[bool]]]:
        """(micro-batches, placeholder flags) of each step of `epoch` from step `start` on."""
        if isinstance(plan, StreamPlan | LoaderPlan):
            yield from plan.epoch(epoch, start)
            return
        micro_batches = iter(self.loader(plan, epoch, start))
        permutation = plan.permutation(epoch)
        for step in range(start, plan.steps_per_epoch):
            batches = [next(micro_batches) for _ in range(self.accumulation_steps)]
            # a micro-batch of the epoch's short end that stands in for no sample (see BatchPlan)
            yield batches, [min(ix) < 0 for ix in plan.micro_batches(permutation, step, epoch)]

    def slot_batches(self, plan: BatchPlan, epoch: int, step: int, dp_rank: int
                     ) -> tuple[list[dict[str, Any]], list[bool]]:
        """Data rank `dp_rank`'s micro-batches of one step, collated as that rank collates them (its seeds): a
        replica group's lost share, re-fed to this rank (`train.loop.replica_gate`)."""
        other = dataclasses.replace(plan, dp_rank=dp_rank)
        loading = CollatingDataset(self.dataset, self.collator)
        micro = other.micro_batches(other.permutation(epoch), step, epoch)
        return [loading.__getitems__(indices) for indices in micro], [min(ix) < 0 for ix in micro]

    def _user_loader_plan(self, user_loader: Callable[[], Any], owner: str,
                          resumed: Callable[[Any, int], Any] | None = None) -> LoaderPlan:
        """The steps of an overridden `get_train_dataloader`, checked to give every rank as many batches."""
        problem, plan = None, None
        try:
            plan = LoaderPlan(user_loader(), self.accumulation_steps, self.per_device_batch, self.dp_size,
                              counts=per_rank, resumed=resumed)
        except DataError as err:
            problem = str(err)
        agree(problem)
        lengths = per_rank(plan.batches_per_epoch)
        if len(set(lengths)) > 1:
            raise DataError(f"get_train_dataloader() gives the ranks different numbers of batches per epoch "
                            f"({lengths}); every rank must run the same steps: give each rank as many batches "
                            "(e.g. a DistributedSampler, or self.accelerator.prepare(loader))")
        if self.rank == 0:
            warnings.warn(OVERRIDE_WARNING.format(owner=owner), stacklevel=4)
        return plan

    def _global_sample_count(self, local: int) -> int:
        """Samples of a step over the data-parallel ranks (cp and tp ranks load the same ones)."""
        return over_data_ranks(local, self.all_reduce, self.device, self.dp_size, self.world_size)


class _StreamMicroBatches(IterableDataset):
    """The collated micro-batches of one pass of a `StreamPlan`, in order (what `get_train_dataloader` returns
    for a stream)."""

    def __init__(self, plan: StreamPlan, epoch: int, start_step: int) -> None:
        self.plan, self.epoch, self.start_step = plan, epoch, start_step

    def __iter__(self) -> Iterator[Any]:
        for batches, _ in self.plan.epoch(self.epoch, self.start_step):
            yield from batches
