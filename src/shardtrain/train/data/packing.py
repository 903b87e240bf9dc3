"""Padding-free packing for the plain Trainer: `TrainingArguments(pack_sequences=True)`.

    args = TrainingArguments("out", fsdp=True, pack_sequences=True, per_device_train_batch_size=8)
    Trainer(model, args, train_dataset=tokenized).train()   # samples with input_ids (and optionally labels)

Each training micro-batch becomes one row: the samples' `input_ids` concatenated, `position_ids` restarting at 0
for every document, and each document's first label ignored (transformers' `DataCollatorWithFlattening` builds
it). No padding is computed. Attention never crosses a document: transformers builds a block-diagonal mask from
the restarting positions (SDPA, eager and flex on any device; flash-attention's varlen kernel gets the
documents' boundaries as `cu_seq_lens_*`); under context parallelism shardtrain's gathered-K/V attention adds the
same document mask (`parallel/context.py`). The loss stays the mean over every target token of the global batch,
so a packed step has the loss and gradients of the unpacked step on the same samples.

Evaluation and prediction keep padded batches (one row per sample): metrics and predictions stay per sample.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardtrain.errors import TrainingArgumentsError
from shardtrain.model_facts import base_model
from shardtrain.train.step.loss import is_causal_lm


def check_packing(model: nn.Module, data_collator: Any, *, use_cache: bool) -> None:
    """Refuse `pack_sequences=True` where documents would not be kept apart.

    Raises:
        TrainingArgumentsError: a collator of the user's, a model that is not a causal LM or whose attention
            mask does not come from transformers' masking utilities, or a KV cache (which turns that mask off).
    """
    name = type(base_model(model)).__name__
    where = "TrainingArguments.pack_sequences = True"
    if data_collator is not None:
        raise TrainingArgumentsError(
            f"{where} packs batches with transformers' DataCollatorWithFlattening, and a data_collator "
            f"({type(data_collator).__name__}) was given too; drop data_collator, or set pack_sequences False and "
            "pack in your own collator (TRL: SFTConfig(packing=True) or padding_free=True)")
    if not is_causal_lm(model):
        raise TrainingArgumentsError(f"{where} packs the token sequences of causal language models; {name} is not "
                                     "one; set pack_sequences False")
    if not getattr(type(base_model(model)), "_supports_attention_backend", False):
        raise TrainingArgumentsError(
            f"{where} needs a model whose attention mask comes from transformers' masking utilities (they keep "
            f"packed documents apart); {name} has no _supports_attention_backend, so its documents would attend to "
            "each other; use a model such as Llama, Qwen2 or Mistral, or set pack_sequences False")
    if use_cache:
        raise TrainingArgumentsError(
            f"{where} with use_cache = True: transformers builds the packed (block-diagonal) mask only without a "
            "KV cache; set use_cache False")


def packing_collator(model: nn.Module, *, context_parallel: bool) -> Any:
    """transformers' `DataCollatorWithFlattening`, with flash-attention's boundaries when the model uses it."""
    from transformers import DataCollatorWithFlattening

    attention = str(getattr(getattr(base_model(model), "config", None), "_attn_implementation", None) or "")
    # under context parallelism shardtrain's attention replaces flash-attention and reads the positions instead
    varlen = "flash" in attention and not context_parallel
    return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100, return_flash_attn_kwargs=varlen)
