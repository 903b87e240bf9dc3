"""Token-sum losses, so that a step's loss can be normalised by the global number of target tokens."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardtrain.errors import ChunkedLossError, LossError, TrainingArgumentsError
from shardtrain.model_facts import IGNORE_INDEX, TARGET_KEYS
from shardtrain.parallel.context import SHARD_KWARG
from shardtrain.train.step.chunked_loss import (
    chunked_cross_entropy,
    head_returns_input,
    output_head,
    resolve_chunk_size,
)
from shardtrain.train.step.micro import MicroStep


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
    """The logits of a forward without labels: a tensor, `outputs.logits`, or a tuple's first element."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):  # ModelOutput (also a dataclass) or a plain dict
        return outputs.get("logits")
    if isinstance(outputs, tuple | list) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    return getattr(outputs, "logits", None)


def _loss_and_logits(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits) of a forward with labels, read as Hugging Face's Trainer reads them: `outputs["loss"]`
    for a dict or ModelOutput, else (loss, logits, ...) by position."""
    if isinstance(outputs, dict):
        logits = outputs.get("logits")
        if logits is None:  # the first other tensor (e.g. a regression head's "predictions")
            logits = next((v for k, v in outputs.items() if k != "loss" and isinstance(v, torch.Tensor)), None)
        return outputs.get("loss"), logits
    if isinstance(outputs, tuple | list):  # (loss, prediction, ...): several predictions make a tuple, as in HF
        rest = tuple(outputs[1:])
        return (outputs[0] if outputs else None), (rest[0] if len(rest) == 1 else rest or None)
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs, None
    return getattr(outputs, "loss", None), getattr(outputs, "logits", None)


# Heads whose loss is a cross entropy over integer labels: shardtrain computes it as an exact sum
TOKEN_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration", "ForSeq2SeqLM",
               "ForTokenClassification")
SAMPLE_HEADS = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification",
                "ForVideoClassification", "ForMultipleChoice")


def loss_kind(model: nn.Module) -> str:
    """How the Trainer computes this model's loss: "token" (exact token cross entropy), "sample" (exact
    single-label cross entropy when the labels are class ids), "model" (the model's own loss, as a mean over
    the samples of each micro-batch) or "logits" (a plain module without `labels`: cross entropy on its output).
    """
    import inspect

    from shardtrain.checkpoint.model_state import model_class_name, unwrap

    base = unwrap(model)
    if callable(getattr(base, "get_base_model", None)):  # PEFT: the base model decides
        base = base.get_base_model()
    name = model_class_name(base)
    if is_causal_lm(base) or name.endswith(TOKEN_HEADS):
        return "token"
    if name.endswith(SAMPLE_HEADS):
        return "sample"
    from transformers import PreTrainedModel

    if isinstance(base, PreTrainedModel):
        return "model"  # a custom head, a regression or embedding model: its own loss is the reference
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "logits"
    return "model" if "labels" in params else "logits"


def batch_rows(batch: dict[str, Any] | list) -> int:
    """Samples in a collated batch (the first dimension of its first tensor, labels first); a library's batch that
    is a list of samples (TRL's GRPO and RLOO prompts) has its length."""
    if isinstance(batch, list | tuple):
        return len(batch)
    for key in ("labels", *batch):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def _without_logits(outputs: Any) -> Any:
    """The outputs of a chunked forward, whose `logits` are really the head's input: without them."""
    if isinstance(outputs, dict):  # transformers' ModelOutput (a dataclass and an OrderedDict) or a plain dict
        kept = {k: v for k, v in outputs.items() if k != "logits"}
        try:
            return type(outputs)(**kept)
        except TypeError:
            return kept
    return None


LABEL_KEYS = TARGET_KEYS


def _input_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """Input tokens (Hugging Face's num_input_tokens_seen); samples for models without token inputs."""
    shard = batch.get(SHARD_KWARG)
    if shard is not None:  # context parallelism: this rank's real tokens of the split sequences
        return shard.local_tokens
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    if "input_ids" in batch:
        return torch.tensor(batch["input_ids"].numel())
    return torch.tensor(batch_rows(batch))


class LossComputer:
    """Computes the summed loss of a batch and the number of items it is summed over.

    Language models, token classifiers and single-label classifiers get an exact cross entropy here (labels
    shifted for causal LMs, -100 ignored), summed over target tokens (or samples). Every other model (regression,
    multi-label, custom and contrastive heads: `loss_kind` "model") trains on its own loss, read as a mean over
    the samples of its micro-batch and weighted by them, so that N ranks and accumulation still equal one
    process; a placeholder micro-batch (`placeholder` set by the Trainer) weighs 0. With `chunk_size` > 0
    (`chunked_loss.resolve_chunk_size` decides it) token losses are computed from the head's input,
    `chunk_size` tokens at a time, whenever the logits themselves are not needed.
    """

    def __init__(self, model: nn.Module, device: torch.device, bf16_autocast: bool = False,
                 chunk_size: int = 0, label_smoothing: float = 0.0) -> None:
        self.model, self.device = model, device
        self.shift_labels = is_causal_lm(model)
        self.kind = loss_kind(model)
        self.bf16_autocast = bf16_autocast
        self.chunk_size = chunk_size
        self.label_smoothing = float(label_smoothing)  # Hugging Face's label_smoothing_factor (torch's formula)
        self.current: MicroStep | None = None  # the micro-batch in progress (OptimizerStep's, or evaluation's)
        self._config = getattr(model, "config", None)

    @classmethod
    def for_run(cls, model: nn.Module, device: torch.device, args: Any, *, chunk: int | str | None,
                tensor_parallel: bool) -> LossComputer:
        """The loss of a run with `TrainingArguments` `args`: autocast under bf16 without FSDP, the chunk size
        (`chunk`: the run's `loss_chunk_size`, "auto" resolved for the model), Hugging Face's label smoothing."""
        chunk = resolve_chunk_size(chunk, model, tensor_parallel=tensor_parallel, device_type=device.type)
        smoothing = args.label_smoothing_factor
        if smoothing and getattr(getattr(model, "config", None), "problem_type", None) == \
                "multi_label_classification":  # Hugging Face's rule and warning
            warnings.warn("Label smoothing is not compatible with multi-label classification. Disabling label "
                          "smoothing for this training run.", UserWarning, stacklevel=4)
            smoothing = 0.0
        computer = cls(model, device, bf16_autocast=args.bf16 and not args.fsdp_enabled, chunk_size=chunk,
                       label_smoothing=smoothing)
        if smoothing and computer.kind == "model":
            raise TrainingArgumentsError(
                f"TrainingArguments.label_smoothing_factor = {args.label_smoothing_factor} with "
                f"{type(model).__name__}, which is trained on its own loss (not a cross entropy shardtrain "
                "computes); set label_smoothing_factor 0, or smooth the labels in the model's loss")
        return computer

    def uses_model_loss(self, batch: dict[str, Any]) -> bool:
        """Whether `batch` is trained on the model's own loss rather than an exact cross entropy."""
        if self.kind == "model":
            return True
        labels = batch.get("labels")
        if labels is None:
            return "shift_labels" not in batch  # no labels: only the model knows its loss
        if labels.is_floating_point():
            return True  # regression, multi-label targets, soft labels
        if self.kind == "sample":
            problem = getattr(self._config, "problem_type", None)
            return problem not in (None, "single_label_classification") or \
                getattr(self._config, "num_labels", 2) == 1
        return False

    def targets(self, batch: dict[str, Any]) -> torch.Tensor:
        """The labels aligned with the logits: `shift_labels` when the batch has them (context parallelism
        shifts before splitting), else `labels`, shifted here for causal LMs."""
        if "shift_labels" in batch:
            return batch["shift_labels"]
        labels = batch["labels"]
        if labels.dim() > 1 and self.shift_labels:
            return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return labels

    @contextlib.contextmanager
    def running(self, micro: MicroStep | None) -> Iterator[None]:
        """`micro` as the micro-step in progress while the block runs (`current`): code with Hugging Face's
        signatures (`training_step`, a library's `compute_loss`) reads it there; None after."""
        self.current = micro
        try:
            yield
        finally:
            self.current = None

    @property
    def placeholder(self) -> bool:
        """Whether the current micro-batch stands in for no sample (an epoch's short end): it weighs 0."""
        return self.current is not None and self.current.placeholder

    def standing_in(self) -> bool:
        """Whether the current micro-batch is a placeholder (it stands in for no sample)."""
        return self.placeholder

    def items(self, batch: dict[str, Any], placeholder: bool | None = None, by_samples: bool = False) -> torch.Tensor:
        """Target tokens (or samples: a model's own loss, or `by_samples`) of `batch` that the loss is summed over."""
        placeholder = self.placeholder if placeholder is None else placeholder
        if placeholder:  # whatever a collator made of the placeholder sample (e.g. labels from a completion mask)
            return torch.tensor(0)
        if by_samples or self.uses_model_loss(batch):
            return torch.tensor(batch_rows(batch))
        return (self.targets(batch) != IGNORE_INDEX).sum()

    def local_counts(self, batches: list[dict[str, Any]], placeholders: list[bool] | None = None,
                     by_samples: bool = False) -> torch.Tensor:
        """(target tokens or samples, input tokens) of this rank's micro-batches, float64 on the device."""
        placeholders = placeholders or [False] * len(batches)
        targets = sum(self.items(batch, p, by_samples) for batch, p in zip(batches, placeholders, strict=True))
        # a placeholder stands in for no sample: its tokens are not seen (num_input_tokens_seen)
        inputs = sum(_input_tokens(batch) for batch, p in zip(batches, placeholders, strict=True) if not p)
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
        if self.uses_model_loss(batch):
            return self._model_loss(batch)
        labels = self.targets(batch)
        batch = self._with_decoder_inputs(batch)
        if self.chunk_size and not keep_logits and labels.dim() > 1:
            return self._chunked(batch, labels)
        with self._autocast():
            outputs = self.model(**{k: v for k, v in batch.items() if k not in LABEL_KEYS})
        logits = _logits(outputs)
        if logits is None:
            raise LossError(f"{type(self.model).__name__} returned no logits (outputs: {type(outputs).__name__}); "
                            "return logits, or a loss from forward(labels=...)")
        if labels.dim() == 1:
            config = getattr(self.model, "config", None)
            if config is not None and getattr(config, "problem_type", "") is None:
                config.problem_type = "single_label_classification"  # what the model itself would record
            return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum",
                                   label_smoothing=self.label_smoothing), outputs
        # `targets` shifted the labels, not the logits: no copy of the logits, no padded grad
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=self.label_smoothing)
        return loss, outputs

    def _with_decoder_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An encoder-decoder batch without `decoder_input_ids` (the default collator's): the model would build
        them from the labels it is not given here, so build them as it does (`prepare_decoder_input_ids_from_labels`:
        T5's `_shift_right`, BART's `shift_tokens_right`)."""
        prepare = getattr(self.model, "prepare_decoder_input_ids_from_labels", None)
        if "decoder_input_ids" in batch or "decoder_inputs_embeds" in batch or "labels" not in batch or \
                not callable(prepare) or not getattr(getattr(self.model, "config", None), "is_encoder_decoder", False):
            return batch
        return {**batch, "decoder_input_ids": prepare(labels=batch["labels"])}

    def _model_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """The model's own loss (a mean over the batch's samples) as a sum: x samples, 0 for a placeholder."""
        with self._autocast():
            outputs = self.model(**{k: v for k, v in batch.items() if k != "shift_labels"})
        loss, _ = _loss_and_logits(outputs)
        if loss is None:
            raise LossError(f"{type(self.model).__name__} returned no loss for a batch with keys {sorted(batch)}; "
                            "its forward must compute a loss from its inputs (e.g. forward(labels=...)), or "
                            "pass compute_loss_func / override compute_loss")
        return loss.float() * (0 if self.placeholder else batch_rows(batch)), outputs

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
        return loss, (_loss_and_logits(outputs)[1] if self.uses_model_loss(batch) else _logits(outputs))

    def through_pipeline(self, pipeline: Any, batch: dict[str, torch.Tensor], num_items: Any) -> torch.Tensor:
        """Forward and backward of `batch` over a pipeline's schedule (`parallel.pipeline.Pipeline`): the token
        cross entropy on its last stage, each gradient times the micro-step's scale (1 / `num_items` outside a
        step); the loss sum on the last stage, 0 on the others. A placeholder weighs 0."""
        weight = 0.0 if self.placeholder else 1.0
        scale = self.current.grad_scale if self.current is not None else 1 / num_items
        inputs = {k: v for k, v in batch.items() if k not in LABEL_KEYS}
        return pipeline.train(inputs, self.targets(batch), grad_scale=scale * weight,
                              label_smoothing=self.label_smoothing) * weight

    def with_labels(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A causal LM batch without labels (e.g. from DataCollatorWithPadding) learns every next token."""
        if "labels" in batch or not self.shift_labels or "input_ids" not in batch:
            return batch
        labels = batch["input_ids"].clone()
        if "attention_mask" in batch:
            labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return {**batch, "labels": labels}

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The model's logits for a batch without labels (prediction); a tuple output of several tensors gives
        them all, as Hugging Face's predictions."""
        with self._autocast():
            outputs = self.model(**batch)
        if isinstance(outputs, tuple | list) and len(outputs) > 1 and \
                all(isinstance(v, torch.Tensor) for v in outputs):
            return tuple(outputs)
        return _logits(outputs)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward(batch)[0]
