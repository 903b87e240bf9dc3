"""Put another library's `transformers.Trainer` subclass on shardtrain's engine.

    from trl import SFTConfig, SFTTrainer
    import shardtrain
    Trainer, Config = shardtrain.on_engine(SFTTrainer), shardtrain.arguments_on_engine(SFTConfig)
    Trainer(model, args=Config("out", fsdp=True, ...), train_dataset=ds, processing_class=tok).train()

`on_engine(X)` is `class X(X, shardtrain.Trainer)`: X's methods (its loss, logging, dataset preparation) run
first and call up into shardtrain's Trainer where they call Hugging Face's, so the training loop, FSDP2,
checkpoints and the exact global-token loss are shardtrain's. `arguments_on_engine(C)` is the matching
`@dataclass class C(C, shardtrain.TrainingArguments)`: C's fields and defaults with shardtrain's checks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import transformers

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.arguments import TrainingArguments
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
        trainer_cls.__init__(self, *args, **kwargs)
        self._parallelize_side_models()  # e.g. DPO's reference model, built by the library's __init__

    # a library's own arguments class (sentence-transformers' `training_args_class`) becomes the engine's too
    arguments = {name: arguments_on_engine(value) for klass in reversed(trainer_cls.__mro__)
                 for name, value in vars(klass).items()
                 if isinstance(value, type) and issubclass(value, transformers.TrainingArguments)}
    return type(trainer_cls.__name__, (trainer_cls, Trainer), {**arguments,
        "__module__": __name__, "__qualname__": trainer_cls.__qualname__, "__init__": __init__,
        "labels_from_inputs": False,
        "__doc__": f"{trainer_cls.__name__} on shardtrain's FSDP2 engine (shardtrain.on_engine).\n\n"
                   f"{trainer_cls.__doc__ or ''}"})


@functools.cache
def arguments_on_engine(arguments_cls: type) -> type:
    """`arguments_cls` (a `transformers.TrainingArguments` dataclass subclass) with shardtrain's fields and
    checks; cached per class."""
    if not (isinstance(arguments_cls, type) and issubclass(arguments_cls, transformers.TrainingArguments)):
        raise TrainingArgumentsError(
            f"arguments_on_engine() takes a transformers.TrainingArguments subclass, got {arguments_cls!r}")
    if issubclass(arguments_cls, TrainingArguments):
        return arguments_cls
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": arguments_cls.__qualname__,
                                 "__doc__": arguments_cls.__doc__}
    return dataclasses.dataclass(type(arguments_cls.__name__, (arguments_cls, TrainingArguments), namespace))
