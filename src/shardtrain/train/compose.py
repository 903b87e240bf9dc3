"""Put another library's `transformers.Trainer` subclass on shardtrain's engine.

    from trl import SFTConfig, SFTTrainer
    import shardtrain
    Trainer, Config = shardtrain.on_engine(SFTTrainer), shardtrain.arguments_on_engine(SFTConfig)
    Trainer(model, args=Config("out", fsdp=True, ...), train_dataset=ds, processing_class=tok).train()

`on_engine(X)` is `class X(X, shardtrain.Trainer)`: X's methods (its loss, logging, dataset preparation) run
first and call up into shardtrain's Trainer where they call Hugging Face's, so the training loop, FSDP2,
checkpoints and the exact global-token loss are shardtrain's. `arguments_on_engine(C)` is the matching
`@dataclass class C(C, shardtrain.TrainingArguments)`: C's fields and defaults with shardtrain's checks.
With `cpu_ram_efficient_loading`, a model the library loads from a local directory is built on the meta device
and each rank reads only its shards (`loads_on_meta`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import transformers

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.arguments import arguments_on_engine
from shardtrain.train.trainer import Trainer


@functools.cache
def on_engine(trainer_cls: type) -> type:
    """`trainer_cls` (a `transformers.Trainer` subclass) running on shardtrain's engine; cached per class."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TrainingArgumentsError(f"on_engine() takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, Trainer):
        return trainer_cls

    @functools.wraps(trainer_cls.__init__)
    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        given = inspect.signature(trainer_cls.__init__).bind_partial(self, *args, **kwargs).arguments
        with loads_on_meta(given.get("model"), given.get("args"), given.get("peft_config")):
            trainer_cls.__init__(self, *args, **kwargs)
            self._parallelize_side_models()  # e.g. DPO's reference model, built by the library's __init__

    # a library's own arguments class (sentence-transformers' `training_args_class`) becomes the engine's too
    arguments = {name: arguments_on_engine(value) for klass in reversed(trainer_cls.__mro__)
                 for name, value in vars(klass).items()
                 if isinstance(value, type) and issubclass(value, transformers.TrainingArguments)}
    # sentence-transformers' trainers build their loader from their own batch samplers (`_build_dataloader`)
    loading = {"get_train_dataloader": global_batch_loader} if hasattr(trainer_cls, "_build_dataloader") else {}
    return type(trainer_cls.__name__, (trainer_cls, Trainer), {**arguments, **loading,
        "__module__": __name__, "__qualname__": trainer_cls.__qualname__, "__init__": __init__,
        "labels_from_inputs": False,
        "__doc__": f"{trainer_cls.__name__} on shardtrain's FSDP2 engine (shardtrain.on_engine).\n\n"
                   f"{trainer_cls.__doc__ or ''}"})


def global_batch_loader(self: Trainer) -> Any:
    """A sentence-transformers trainer's `get_train_dataloader` on the engine: its batch sampler (NO_DUPLICATES,
    GROUP_BY_LABEL, round-robin over several datasets) draws each step's global batch, the per-device batch times
    the data-parallel ranks, as it draws it on one process with that batch, and each rank takes its contiguous
    share (Accelerate's `split_batches`). Under transformers each rank draws batches of its own size instead, so
    a sampler that looks at the whole batch (no duplicates, one label) gives other batches on N GPUs than on one."""
    from accelerate.data_loader import prepare_data_loader

    if self.train_dataset is None:  # sentence-transformers' own message
        raise ValueError(f"Training requires specifying a train_dataset to the {self.__class__.__name__}.")
    ranks = self.dims.batch_size
    loader = self._build_dataloader(self.train_dataset, self.args.train_batch_size * ranks, dataset_kind="train")
    config = self.accelerator.dataloader_config  # Hugging Face's: seedable samplers, from accelerator_config
    self._train_dataloader = prepare_data_loader(loader, num_processes=ranks, process_index=self.dp_rank,
                                                 split_batches=True, even_batches=False,
                                                 use_seedable_sampler=config.use_seedable_sampler,
                                                 data_seed=config.data_seed)
    return self._train_dataloader


@contextlib.contextmanager
def loads_on_meta(model: Any, args: Any, peft_config: Any) -> Iterator[None]:
    """While a library's `__init__` runs: a model it loads by path (TRL's `create_model_from_path` with
    `args.model_init_kwargs`, the policy and DPO's reference model alike) is built on the meta device, reading
    nothing, when `cpu_ram_efficient_loading` asks for it and the path is a local directory of safetensors; the
    backend then reads each rank's shards from that directory. The user's `model_init_kwargs` are restored after.
    Not with `peft_config` (the library would put adapters on meta tensors), a `device_map` of the user's, or
    `use_kernels=True`: hub kernels are not put on a model built on the meta device (`use_kernels=False`, which
    transformers < 5.25 defaulted to; from 5.25 on `from_pretrained` kernelizes by default, and raises for a
    meta-device model)."""
    kwargs = getattr(args, "model_init_kwargs", False)
    path = Path(model) if isinstance(model, str | os.PathLike) else None
    if (kwargs is False or path is None or peft_config is not None or not getattr(args, "fsdp_enabled", False)
            or not args.fsdp_config.cpu_ram_efficient_loading or "device_map" in (kwargs or {})
            or (kwargs or {}).get("use_kernels")
            or not (path / "config.json").is_file() or not any(path.glob("*.safetensors"))):
        yield
        return
    args.model_init_kwargs = {**(kwargs or {}), "device_map": "meta", "use_kernels": False}
    try:
        yield
    finally:
        args.model_init_kwargs = kwargs
