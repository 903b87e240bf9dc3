"""Accelerate's `Accelerator` on shardtrain's process group, for code written against `transformers.Trainer`.

Libraries built on Hugging Face's Trainer (TRL, sentence-transformers) call `trainer.accelerator` for
collectives and process facts: `gather_for_metrics`, `gather`, `reduce`, `num_processes`, `is_main_process`,
`wait_for_everyone`, `unwrap_model`, `device`. Those are Accelerate's own implementations here, running on the
process group shardtrain's backend created. Accelerate never wraps, shards or moves the model, and its
launcher's settings (`ACCELERATE_USE_FSDP`, `ACCELERATE_MIXED_PRECISION`, ...) were already applied by
shardtrain's `TrainingArguments` (`shardtrain.config.accelerate_env`), so they are hidden from it: the
Accelerator built here has no FSDP plugin and no autocast of its own.

`gather_for_metrics` keeps Accelerate's meaning, "gather, leaving out the samples that only even out the
batches": a rank running a placeholder micro-batch (an epoch's short end, which weighs nothing in the loss)
contributes nothing, so a sum such as TRL's `num_tokens` is the one process's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardtrain.config.accelerate_env import PREFIXES


@contextlib.contextmanager
def _without_accelerate_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def engine_accelerator(backend: Any, args: Any = None, standing_in: Callable[[], bool] | None = None) -> Any:
    """An `accelerate.Accelerator` for `backend`'s processes and device (None under PyTorch/XLA, whose device
    and collectives are torch_xla's). Its dataloader settings are `args.accelerator_config`'s, as Hugging Face's
    Trainer passes them (seedable samplers by default), so a library's `accelerator.prepare(loader)` draws the
    batches it draws under transformers' Trainer. `standing_in()` says whether this rank's current micro-batch
    is a placeholder: its `gather_for_metrics` contributions are left out (see the module's docstring)."""
    if getattr(backend, "is_xla", False):
        return None
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    loading = DataLoaderConfiguration()
    accumulation = {}
    config = getattr(args, "accelerator_config", None)
    if config is not None:
        loading = DataLoaderConfiguration(split_batches=config.split_batches, dispatch_batches=config.dispatch_batches,
                                          even_batches=config.even_batches,
                                          use_seedable_sampler=config.use_seedable_sampler,
                                          non_blocking=config.non_blocking)
        loading.data_seed = args.data_seed
        accumulation = dict(config.gradient_accumulation_kwargs or {})
    # Accelerate's process state is a singleton; one created before the process group existed (TRL's dataset
    # preparation calls PartialState()) says "one process". It is rebuilt on the group shardtrain set up.
    if PartialState._shared_state and PartialState().num_processes != backend.world_size:
        AcceleratorState._reset_state(reset_partial_state=True)
    with _without_accelerate_env():
        accelerator = Accelerator(cpu=backend.device.type == "cpu", mixed_precision="no", device_placement=False,
                           dataloader_config=loading,
                           # as Hugging Face's: the Trainer accumulates, Accelerate's own count stays 1
                           gradient_accumulation_plugin=GradientAccumulationPlugin(**{**accumulation, "num_steps": 1}))
    if standing_in is not None:
        accelerator.gather_for_metrics = _without_stand_ins(accelerator, standing_in)
    return accelerator


class LazyAccelerator:
    """The Trainer's `accelerator` attribute: an `engine_accelerator` built on first use from the Trainer's
    `backend`, `args` and `loss_computer` (never before a library asks for it); an assignment replaces it, and
    None makes the next use build it again (after a hyperparameter trial changed the arguments)."""

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        if trainer.__dict__.get("_accelerator") is None:
            trainer.__dict__["_accelerator"] = engine_accelerator(
                trainer.backend, trainer.args, standing_in=trainer.loss_computer.standing_in)
        return trainer.__dict__["_accelerator"]

    def __set__(self, trainer: Any, value: Any) -> None:
        trainer.__dict__["_accelerator"] = value

    @staticmethod
    def built(trainer: Any) -> Any:
        """The accelerator if one was built (or set), else None: nothing is built."""
        return trainer.__dict__.get("_accelerator")


def _without_stand_ins(accelerator: Any, standing_in: Callable[[], bool]) -> Callable[..., Any]:
    """Accelerate's `gather_for_metrics`, leaving out the ranks whose micro-batch is a placeholder. Where every
    rank's is (a micro-step past an epoch's last sample), each contributes zeros: sums stay the one process's
    and means stay finite in a micro-batch that weighs nothing."""
    from accelerate.utils import gather_object, recursively_apply

    gather_for_metrics = accelerator.gather_for_metrics

    def gather_real(input_data: Any, use_gather_object: bool = False) -> Any:
        flags = accelerator.gather(torch.tensor([int(standing_in())], device=accelerator.device)).tolist()
        if not any(flags):
            return gather_for_metrics(input_data, use_gather_object)
        keep = [rank for rank, flag in enumerate(flags) if not flag]
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        if not tensors:  # as Accelerate's gather_object: the ranks' lists joined
            per_rank = gather_object([input_data])
            kept = [per_rank[rank] for rank in keep]
            return [x for item in kept for x in item] if isinstance(input_data, (list, tuple)) else kept
        if not keep:
            return recursively_apply(torch.zeros_like, accelerator.gather(input_data))

        def real_rows(gathered: torch.Tensor) -> torch.Tensor:
            parts = gathered.split(gathered.shape[0] // len(flags))
            return torch.cat([parts[rank] for rank in keep])

        return recursively_apply(real_rows, accelerator.gather(input_data))

    return gather_real
