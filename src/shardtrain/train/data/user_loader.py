"""Training batches from an overridden `get_train_dataloader` (a subclass's, or a library's such as
sentence-transformers' batch samplers), consumed as Hugging Face's training loop consumes them.

    class MyTrainer(shardtrain.Trainer):
        def get_train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=4, collate_fn=my_collate)

`get_train_dataloader()` is called once per `train()`, as Hugging Face calls it. Its batches are this rank's
micro-batches: each optimizer step takes the next `gradient_accumulation_steps` of them (the last step of an epoch
takes what is left), the loader's `set_epoch` (and that of the batch sampler inside Accelerate's wrapper) is called
at each epoch, and a resume skips the batches the finished steps used (Hugging Face's `skip_first_batches`; an
overridden `get_resumed_dataloader`, transformers >= 5.25, is called instead, with the loader and those batches'
count, and the resumed epoch reads what it returns). The loss is still the exact mean over the global batch's target
tokens. What shardtrain's own batch plan adds is off, and a warning says so: which samples a step sees now depends
on how the loader splits the data over ranks (a plain `DataLoader` gives every rank the same batches), and a resume
is exact only when the loader yields the same batches in each epoch on every read.

A loader without a length (over an `IterableDataset`, e.g. TRL's GRPO on a streamed dataset) is read as
Hugging Face reads it: `max_steps` is required, a pass ends when the loader runs out and the next pass reads it
again. Its position (pass, step) is saved with each checkpoint, as a stream's is. The ranks compare their
micro-batch counts at each step (a collective): a step that finds them different is refused with a DataError,
since every rank must run the same forward and backward passes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from shardtrain.errors import DataError, TrainingArgumentsError

OVERRIDE_WARNING = (
    "get_train_dataloader is overridden ({owner}): training takes its batches as this rank's micro-batches, as "
    "Hugging Face does; shardtrain's batch plan (the same samples per step on any layout, resume on another "
    "world size) is off, so the samples of a step depend on how that loader splits the data over ranks, and a "
    "resume skips the batches already used (exact when each epoch yields the same batches)")


@dataclass
class LoaderPlan:
    """The steps of a user's training loader (see the module docstring); counterparts: `BatchPlan`, `StreamPlan`.

    Args:
        loader: what `get_train_dataloader()` returned (with a length, it must be the same on every rank).
        accumulation_steps: micro-batches per optimizer step.
        per_device_batch_size: for the global batch size of the state and of the checkpoint's check.
        dp_size: data-parallel ranks.
        counts: collective, every rank's micro-batch count of a step (read only for a loader without a length).
        resumed: an overridden `get_resumed_dataloader(loader, num_batches)` (Hugging Face's, transformers >= 5.25):
            where a resume starts inside an epoch, the batches of that epoch are read from what it returns, as
            Hugging Face's `_run_epoch` reads them; None: the finished steps' batches are skipped.
    """

    loader: Iterable
    accumulation_steps: int
    per_device_batch_size: int
    dp_size: int
    counts: Callable[[int], list[int]] = lambda n: [n]
    resumed: Callable[[Iterable, int], Iterable] | None = None
    nothing_read = "get_train_dataloader() gave no batch; check train_dataset and its batch size"

    def __post_init__(self) -> None:
        try:
            self.batches_per_epoch: int | None = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            self.batches_per_epoch = None  # read until it runs out
        if self.batches_per_epoch == 0:
            raise DataError("get_train_dataloader() returned an empty loader; check train_dataset and its batch size")

    @property
    def steps_per_epoch(self) -> int:
        """Steps of a pass; 0 when the loader has no length (as a stream's plan says)."""
        if self.batches_per_epoch is None:
            return 0
        return -(-self.batches_per_epoch // self.accumulation_steps)  # the last step takes what is left

    def check_arguments(self, args: Any) -> None:
        """Hugging Face's rule for a loader without a length: the step count comes from `max_steps`."""
        if self.batches_per_epoch is None and args.max_steps <= 0:
            raise TrainingArgumentsError(f"get_train_dataloader() returned a {type(self.loader).__name__} without a "
                                         "length, so the number of steps cannot come from num_train_epochs; set "
                                         "TrainingArguments.max_steps")

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.accumulation_steps * self.dp_size

    def epoch(self, epoch: int, start_step: int) -> Iterator[tuple[list[Any], list[bool]]]:
        """(micro-batches, placeholder flags) of each step of `epoch` from `start_step` on."""
        if callable(getattr(self.loader, "set_epoch", None)):
            self.loader.set_epoch(epoch)
        # Accelerate's DataLoaderShard does not forward set_epoch to a batch sampler wrapped in BatchSamplerShard
        inner = getattr(getattr(self.loader, "batch_sampler", None), "batch_sampler", None)
        if callable(getattr(inner, "set_epoch", None)):
            inner.set_epoch(epoch)
        if start_step and self.resumed is not None:  # Hugging Face's override point, called as _run_epoch calls it
            loader = self.resumed(self.loader, start_step * self.accumulation_steps)
            if loader is not self.loader and callable(getattr(loader, "set_epoch", None)):
                loader.set_epoch(epoch)  # as Hugging Face sets the epoch of the loader it reads
            batches = iter(loader)
        else:
            batches = iter(self.loader)
            for _ in itertools.islice(batches, start_step * self.accumulation_steps):  # used before the resume
                pass
        steps = range(start_step, self.steps_per_epoch) if self.batches_per_epoch is not None else \
            itertools.count(start_step)
        for _ in steps:
            step = list(itertools.islice(batches, self.accumulation_steps))
            if self.batches_per_epoch is None:
                counts = self.counts(len(step))
                if len(set(counts)) > 1:
                    raise DataError(f"get_train_dataloader() gave the ranks different numbers of micro-batches for "
                                    f"one step ({counts}); every rank must run the same steps: give each rank as "
                                    "many batches (e.g. split the stream with datasets.distributed."
                                    "split_dataset_by_node, or self.accelerator.prepare(loader))")
            if not step:
                return
            yield step, [False] * len(step)
