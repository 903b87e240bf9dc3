"""Training on a stream: `torch.utils.data.IterableDataset` or `datasets` streaming (`load_dataset(...,
streaming=True)`), with `max_steps`.

Step s of a pass over the stream uses its elements [s*G, (s+1)*G) (G = per-device batch x accumulation x
data-parallel ranks), as one process reading G at a time would: data-parallel rank r keeps the elements whose
index is r modulo the data-parallel size (the example-level split `datasets.distributed.split_dataset_by_node`
makes), and its micro-step m takes the next per-device batch of them. So a step's samples do not depend on how
the global batch is split, and the step's loss (a global token mean) equals one process's. Every rank reads the
whole stream to find its elements; a dataset that shards itself by node instead would make the global batch
depend on the layout.

The position in the stream (the pass and the step within it) is saved in every checkpoint
(`TrainerState.data_epoch` / `data_step`); a resume reads the stream again from its start and skips to it, so the
resumed steps see the samples an uninterrupted run sees (the stream must give the same elements in the same
order on every pass it is read, e.g. a seeded `shuffle` with `set_epoch`). When the stream ends, the pass ends
(a short last step is completed with placeholders that weigh nothing) and the next pass starts, until
`max_steps`. Each micro-batch is collated under its own seed, as in `BatchPlan`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.data.batch_plan import PlaceholderDataset, derive_seed, isolated_rng


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read by iterating (no `__len__`/`__getitem__`): torch's or `datasets`' iterable."""
    if isinstance(dataset, IterableDataset):
        return True
    try:
        import datasets

        if isinstance(dataset, datasets.IterableDataset):
            return True
    except ImportError:
        pass
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) and hasattr(dataset, "__iter__")


def check_stream_arguments(args: Any) -> None:
    """The settings a stream needs: a step count (its length is unknown) and step-based strategies."""
    if args.max_steps <= 0:
        raise TrainingArgumentsError("train_dataset is a stream (an IterableDataset, no length), so the number of "
                                     "steps cannot come from num_train_epochs; set TrainingArguments.max_steps")
    for name in ("eval_strategy", "save_strategy", "logging_strategy"):
        if getattr(args, name) == "epoch":
            raise TrainingArgumentsError(f"TrainingArguments.{name} = 'epoch' with a stream as train_dataset: a "
                                         f"pass has no known length; use {name}='steps'")
    if args.dataloader_num_workers:
        raise TrainingArgumentsError("dataloader_num_workers > 0 with a stream as train_dataset: the stream is "
                                     "read in the training process (each rank keeps its share of it); set 0")


@dataclass
class StreamPlan:
    """How a stream is cut into steps (see the module docstring); the map-style counterpart is `BatchPlan`.

    `global_count(n)` sums this rank's sample count over the data-parallel ranks (a collective); it tells every
    rank together when a pass is over.
    """

    dataset: Any
    collator: Callable[[list[Any]], Any]
    per_device_batch_size: int
    accumulation_steps: int
    dp_size: int
    dp_rank: int
    seed: int
    global_count: Callable[[int], int]
    steps_per_epoch: int = 0  # unknown until a pass ends; the Trainer's state counts passes in data_epoch
    nothing_read = "train_dataset (a stream) gave no sample; check that iterating it yields samples"

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.accumulation_steps * self.dp_size

    def epoch(self, epoch: int, start_step: int) -> Iterator[tuple[list[Any], list[bool]]]:
        """(collated micro-batches, placeholder flags) of each step of pass `epoch` from `start_step` on."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # datasets' seeded shuffle: the same order on every read of a pass
        # Reading the stream never draws from the training RNG (dropout): every read runs under its own seed
        with isolated_rng(derive_seed(self.seed, "stream", epoch, self.dp_rank)):
            stream = iter(self.dataset)
            first = next(stream, None)
            if first is None:
                return
            template = PlaceholderDataset([first])  # index -1: the first element with every label ignored
            mine = itertools.islice(itertools.chain([first], stream), self.dp_rank, None, self.dp_size)
            per_step = self.per_device_batch_size * self.accumulation_steps
            for _ in itertools.islice(mine, start_step * per_step):  # what the run before the resume used
                pass
        for step in itertools.count(start_step):
            seeds = [derive_seed(self.seed, "train", epoch, step, m, self.dp_rank)
                     for m in range(self.accumulation_steps)]
            micro = []
            for seed in seeds:
                with isolated_rng(seed):
                    micro.append(list(itertools.islice(mine, self.per_device_batch_size)))
            if self.global_count(sum(map(len, micro))) == 0:
                return
            batches = []
            for seed, items in zip(seeds, micro, strict=True):
                with isolated_rng(seed):
                    batches.append(self.collator(items or [template[-1]]))
            yield batches, [not items for items in micro]
