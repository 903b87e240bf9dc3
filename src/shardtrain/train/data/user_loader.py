"""Training batches from an overridden `get_train_dataloader` (a subclass's, or a library's such as
sentence-transformers' batch samplers), consumed as Hugging Face's training loop consumes them.

    class MyTrainer(shardtrain.Trainer):
        def get_train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=4, collate_fn=my_collate)

`get_train_dataloader()` is called once per `train()`, as Hugging Face calls it. Its batches are this rank's
micro-batches: each optimizer step takes the next `gradient_accumulation_steps` of them (the last step of an
epoch takes what is left), the loader's `set_epoch` (and that of the batch sampler inside Accelerate's wrapper)
is called at each epoch, and a resume skips the batches the finished steps used (Hugging Face's
`skip_first_batches`). The loss is still the exact mean over the global batch's target tokens. What shardtrain's
own batch plan adds is off, and a warning says so: which samples a step sees now depends on how the loader
splits the data over ranks (a plain `DataLoader` gives every rank the same batches), and a resume is exact only
when the loader yields the same batches in each epoch on every read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from shardtrain.errors import DataError

OVERRIDE_WARNING = (
    "get_train_dataloader is overridden ({owner}): training takes its batches as this rank's micro-batches, as "
    "Hugging Face does; shardtrain's batch plan (the same samples per step on any layout, resume on another "
    "world size) is off, so the samples of a step depend on how that loader splits the data over ranks, and a "
    "resume skips the batches already used (exact when each epoch yields the same batches)")


@dataclass
class LoaderPlan:
    """The steps of a user's training loader (see the module docstring); counterparts: `BatchPlan`, `StreamPlan`.

    Args:
        loader: what `get_train_dataloader()` returned (it must have a length, the same on every rank).
        accumulation_steps: micro-batches per optimizer step.
        per_device_batch_size: for the global batch size of the state and of the checkpoint's check.
        dp_size: data-parallel ranks.
    """

    loader: Iterable
    accumulation_steps: int
    per_device_batch_size: int
    dp_size: int

    def __post_init__(self) -> None:
        try:
            self.batches_per_epoch = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise DataError(f"get_train_dataloader() returned a {type(self.loader).__name__} without a length; "
                            "return a DataLoader over a map-style dataset (or pass a stream as train_dataset and "
                            "keep shardtrain's own loader)") from None
        if self.batches_per_epoch == 0:
            raise DataError("get_train_dataloader() returned an empty loader; check train_dataset and its batch size")

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.batches_per_epoch // self.accumulation_steps)  # the last step takes what is left

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
        batches = iter(self.loader)
        for _ in itertools.islice(batches, start_step * self.accumulation_steps):  # used before the resume
            pass
        for _ in range(start_step, self.steps_per_epoch):
            step = list(itertools.islice(batches, self.accumulation_steps))
            if not step:
                return
            yield step, [False] * len(step)
