"""Arguments handed over: transformers' `TrainingArguments` (or a library's config, e.g. TRL's `DPOConfig`) given
to shardtrain's Trainer, taken over field by field into the engine's arguments, as if the import had been
switched too (a half-done migration), with one warning that names it.

    args = engine_arguments(transformers.TrainingArguments("out", learning_rate=1e-4))   # warns once
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Any

import transformers
from transformers.trainer_pt_utils import AcceleratorConfig

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.arguments import TrainingArguments, arguments_on_engine


def engine_arguments(args: transformers.TrainingArguments) -> TrainingArguments:
    """`args` as the engine's arguments: itself when it is, else a copy of its fields into
    `arguments_on_engine(type(args))` (a half-done migration: transformers' `TrainingArguments`, or a library's
    config such as TRL's `DPOConfig`, handed to shardtrain's Trainer), with one warning saying so."""
    if isinstance(args, TrainingArguments):
        return args
    if not isinstance(args, transformers.TrainingArguments):
        raise TrainingArgumentsError(f"Trainer(args=...) takes a TrainingArguments, got {type(args).__name__}; "
                                     "pass shardtrain.TrainingArguments(output_dir=..., ...)")
    engine_cls = arguments_on_engine(type(args))
    values = {f.name: _given(args, f) for f in dataclasses.fields(args) if f.init and f.name not in _ALIASES}
    values = {name: value for name, value in values.items() if value is not _DEFAULT}
    derived = _derived(type(args), values)
    values = {name: value for name, value in values.items() if name not in derived}
    warnings.warn(f"Trainer got {type(args).__module__}.{type(args).__qualname__}; its fields are taken over into "
                  f"shardtrain's arguments (the same values). Import TrainingArguments from shardtrain (or use "
                  f"shardtrain.arguments_on_engine({type(args).__name__})) to silence this", stacklevel=3)
    return engine_cls(**values)


_DEFAULT = object()
# transformers' deprecated names, which mirror the new ones after __post_init__ (the new names carry the values)
_ALIASES = frozenset({"gradient_checkpointing", "gradient_checkpointing_kwargs"})


def _given(args: transformers.TrainingArguments, spec: dataclasses.Field) -> Any:
    """The value of field `spec` that `args` was given (enums as their values), or `_DEFAULT` when it holds the
    field's default, or what transformers' `__post_init__` makes of it."""
    value = getattr(args, spec.name)
    default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    if isinstance(value, enum.Enum):
        value = value.value
    if value == default or (spec.name == "accelerator_config" and value == AcceleratorConfig()):
        return _DEFAULT
    return value


def _derived(cls: type, values: dict[str, Any]) -> set[str]:
    """The fields of `values` that `cls.__post_init__` derives from the others: a field whose default is None,
    holding what `cls` built from the other values gives it (TRL's GRPOConfig sets generation_batch_size from
    steps_per_generation). They are not passed again as if set by hand, which that __post_init__ would refuse.
    Empty when `cls` cannot be built so."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    maybe = {name for name in values if defaults.get(name, _DEFAULT) is None}
    if not maybe:
        return set()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = cls(**{name: value for name, value in values.items() if name not in maybe})
    except Exception:  # noqa: BLE001 - e.g. a config that refuses these values here (bf16 without a GPU)
        return set()
    return {name for name in maybe if getattr(reference, name, _DEFAULT) == values[name]}
