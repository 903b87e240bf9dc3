"""How samples become batches when the user gives no collator (Hugging Face's defaults, and packing), and the
column filter of `remove_unused_columns`: the Trainer's training and evaluation collators, built once.

    collators = Collators.build(model=model, processing_class=tokenizer, data_collator=None, pack=False,
                                context_parallel=False, keep_columns=frozenset({"input_ids", "labels"}))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardtrain.train.data.batch_plan import ColumnFilter, PaddingCollator
from shardtrain.train.data.packing import packing_collator
from shardtrain.train.data.validation import ModelLimits
from shardtrain.train.step.loss import is_causal_lm


def default_collator(model: nn.Module, processing_class: Any, *, packed: bool = False,
                     context_parallel: bool = False) -> Callable:
    """Packing's collator (`packed`), `DataCollatorWithPadding` when `processing_class` is a tokenizer (Hugging
    Face's default), transformers' `default_data_collator` for a model without a vocabulary (its inputs are
    features, whatever their names), else `PaddingCollator` (the model's pad token; causal LMs learn their
    inputs)."""
    if packed:
        return packing_collator(model, context_parallel=context_parallel)
    if hasattr(processing_class, "pad"):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(processing_class)
    if ModelLimits.of(model, shift_labels=False).vocab_size is None and not is_causal_lm(model):
        from transformers import default_data_collator  # a model without a vocabulary: its own inputs, as HF

        return default_data_collator
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    return PaddingCollator(pad_token_id=pad_id if pad_id is not None else 0, labels_from_input_ids=is_causal_lm(model))


@dataclass(frozen=True)
class Collators:
    """The training collator, and the evaluation one when it differs (packing trains on packed rows; evaluation
    and prediction keep one row per sample), or None."""

    train: Callable
    unpacked: Callable | None

    @classmethod
    def build(cls, *, model: nn.Module, processing_class: Any, data_collator: Callable | None, pack: bool,
              context_parallel: bool, keep_columns: frozenset[str] | None) -> Collators:
        """The user's `data_collator` or the default (`pack`: packing's), each behind the column filter of
        `keep_columns` (None: keep every column)."""
        train = data_collator or default_collator(model, processing_class, packed=pack,
                                                  context_parallel=context_parallel)
        unpacked = default_collator(model, processing_class) if pack else None
        if keep_columns is not None:
            train = ColumnFilter(train, keep_columns)
            unpacked = ColumnFilter(unpacked, keep_columns) if unpacked is not None else None
        return cls(train, unpacked)
