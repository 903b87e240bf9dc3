"""Token-sum losses, so that a step's loss can be normalised by the global number of target tokens."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardtrain.parallel.context import SHARD_KWARG
from shardtrain.train.chunked_loss import ChunkedLossError, chunked_cross_entropy, head_returns_input, output_head
from shardtrain.train.data import IGNORE_INDEX


def is_causal_lm(model: nn.Module) -> bool:
    """Causal LMs predict token t+1 at position t: their labels are shifted before the loss.

    transformers' own list of causal-LM classes decides (GPT2LMHeadModel is one, without "ForCausalLM" in its
    name); other models count when their name or config says so.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from shardtrain.checkpoint.model_state import model_class_name

    if callable(getattr(model, "get_base_model", None)):  # a PEFT model: its base model decides
        model = model.get_base_model()
    name = model_class_name(model)
    known = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in (v if isinstance(v, tuple) else (v,))}
    config = getattr(model, "config", None)
    return name in known or "ForCausalLM" in name or bool(getattr(config, "is_decoder", False))


def _logits(outputs) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, dict):
        logits = outputs.get("logits")
    return logits


def _without_logits(outputs: Any) -> Any:
    """The outputs of a chunked forward, whose `logits` are really the head's input: without them."""
    if isinstance(outputs, dict):  # transformers' ModelOutput (a dataclass and an OrderedDict) or a plain dict
        kept = {k: v for k, v in outputs.items() if k != "logits"}
        try:
            return type(outputs)(**kept)
        except TypeError:
            return kept
    return None


LABEL_KEYS = ("labels", "shift_labels")


def _input_tokens(batch: dict[str, Any]) -> torch.Tensor:
    shard = batch.get(SHARD_KWARG)
    if shard is not None:  # context parallelism: this rank's real tokens of the split sequences
        return shard.local_tokens
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel())


class LossComputer:
    """Computes the summed loss of a batch and the number of items it is summed over.

    Models that return logits get a cross entropy here (labels shifted for causal LMs, -100 ignored);
    a model that returns only a mean `loss` is scaled back to a sum by its item count. With `chunk_size` > 0
    (`chunked_loss.resolve_chunk_size` decides it) token losses are computed from the head's input,
    `chunk_size` tokens at a time, whenever the logits themselves are not needed.
    """

    def __init__(self, model: nn.Module, device: torch.device, bf16_autocast: bool = False,
                 chunk_size: int = 0) -> None:
        self.model, self.device = model, device
        self.shift_labels = is_causal_lm(model)
        self.bf16_autocast = bf16_autocast
        self.chunk_size = chunk_size

    def targets(self, batch: dict[str, Any]) -> torch.Tensor:
        """The labels aligned with the logits: `shift_labels` when the batch has them (context parallelism
        shifts before splitting), else `labels`, shifted here for causal LMs."""
        if "shift_labels" in batch:
            return batch["shift_labels"]
        labels = batch["labels"]
        if labels.dim() > 1 and self.shift_labels:
            return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return labels

    def items(self, batch: dict[str, Any]) -> torch.Tensor:
        """Target tokens (or samples) of `batch` that the loss is summed over."""
        return (self.targets(batch) != IGNORE_INDEX).sum()

    def local_counts(self, batches: list[dict[str, Any]]) -> torch.Tensor:
        """(target tokens, input tokens) of this rank's micro-batches, float64 on the device, not reduced."""
        targets = sum(self.items(batch) for batch in batches)
        inputs = sum(_input_tokens(batch) for batch in batches)
        return torch.stack([torch.as_tensor(targets), torch.as_tensor(inputs)]).to(self.device, torch.float64)

    def _autocast(self):
        if self.bf16_autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def compute(self, batch: dict[str, torch.Tensor], keep_logits: bool = False) -> tuple[torch.Tensor, Any]:
        """(summed loss, the model's outputs).

        Args:
            batch: model inputs with `labels` (or `shift_labels`).
            keep_logits: the caller needs the logits (predictions, metrics): no chunking. A chunked loss returns
                the outputs without `logits`.
        """
        labels = self.targets(batch)
        if self.chunk_size and not keep_logits and labels.dim() > 1:
            return self._chunked(batch, labels)
        with self._autocast():
            outputs = self.model(**{k: v for k, v in batch.items() if k not in LABEL_KEYS})
        logits = _logits(outputs)
        if logits is None:  # a module that computes its own (mean) loss
            with self._autocast():
                outputs = self.model(**batch)
            return outputs["loss"] * self.items(batch), outputs
        if labels.dim() == 1:
            config = getattr(self.model, "config", None)
            if config is not None and getattr(config, "problem_type", "") is None:
                config.problem_type = "single_label_classification"  # what the model itself would record
            return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"), outputs
        # `targets` shifted the labels, not the logits: no copy of the logits, no padded grad
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, outputs

    def _chunked(self, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
        head = output_head(self.model)
        with self._autocast():
            with head_returns_input(head), warnings.catch_warnings():
                # FSDP2 warns when a unit returns a view (an in-place op on it would skip its hook); the head's
                # input often is one (transformers slices it for logits_to_keep), and nothing writes to it here
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
                outputs = self.model(**{k: v for k, v in batch.items() if k not in LABEL_KEYS})
            hidden = _logits(outputs)
            if hidden is None or isinstance(head.weight, DTensor):
                raise ChunkedLossError("the chunked loss needs the model's head input and its unsharded weight "
                                       "after forward; unset TrainingArguments.loss_chunk_size for this setup")
            loss = chunked_cross_entropy(hidden, head, labels, self.chunk_size)
        return loss, _without_logits(outputs)

    def forward(self, batch: dict[str, torch.Tensor],
                keep_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed loss, logits or None); `keep_logits` as in `compute`."""
        loss, outputs = self.compute(batch, keep_logits=keep_logits)
        return loss, _logits(outputs)

    def with_labels(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A causal LM batch without labels (e.g. from DataCollatorWithPadding) learns every next token."""
        if "labels" in batch or not self.shift_labels:
            return batch
        labels = batch["input_ids"].clone()
        if "attention_mask" in batch:
            labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return {**batch, "labels": labels}

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The model's logits for a batch without labels (prediction)."""
        with self._autocast():
            return _logits(self.model(**batch))

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward(batch)[0]
