"""Accelerate's `Accelerator` on shardtrain's process group, for code written against `transformers.Trainer`.

Libraries built on Hugging Face's Trainer (TRL, sentence-transformers) call `trainer.accelerator` for
collectives and process facts: `gather_for_metrics`, `gather`, `reduce`, `num_processes`, `is_main_process`,
`wait_for_everyone`, `unwrap_model`, `device`. Those are Accelerate's own implementations here, running on the
process group shardtrain's backend created. Accelerate never wraps, shards or moves the model, and its
launcher's settings (`ACCELERATE_USE_FSDP`, `ACCELERATE_MIXED_PRECISION`, ...) were already applied by
shardtrain's `TrainingArguments` (`shardtrain.config.accelerate_env`), so they are hidden from it: the
Accelerator built here has no FSDP plugin and no autocast of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

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


def engine_accelerator(backend: Any, args: Any = None) -> Any:
    """An `accelerate.Accelerator` for `backend`'s processes and device (None under PyTorch/XLA, whose device
    and collectives are torch_xla's). Its dataloader settings are `args.accelerator_config`'s, as Hugging Face's
    Trainer passes them (seedable samplers by default), so a library's `accelerator.prepare(loader)` draws the
    batches it draws under transformers' Trainer."""
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
        return Accelerator(cpu=backend.device.type == "cpu", mixed_precision="no", device_placement=False,
                           dataloader_config=loading,
                           # as Hugging Face's: the Trainer accumulates, Accelerate's own count stays 1
                           gradient_accumulation_plugin=GradientAccumulationPlugin(**{**accumulation, "num_steps": 1}))
