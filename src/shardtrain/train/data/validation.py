"""Checks that run before the first step, so bad input is one clear error instead of a crash inside torch.

`validate_dataset` reads every sample once (each rank a strided share, so N ranks take 1/N of the time),
and the ranks agree on the first problem found; every rank raises the same `DataError`, which rank 0 prints.
It checks what the default collator relies on: for token data (`input_ids`, which causal LMs require) a flat
list of ints in [0, vocab), no longer than the model's positions, labels of the same length (or one class id);
for other data (features, pixels, audio) numeric, finite labels; and at least one target in the whole dataset.
With a custom `data_collator` the samples are the collator's business: only emptiness is checked.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.errors import DataError
from shardtrain.model_facts import IGNORE_INDEX
from shardtrain.parallel import collectives


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """What the model accepts: token ids below `vocab_size`, at most `max_positions` tokens, class ids."""

    vocab_size: int | None
    max_positions: int | None
    num_labels: int | None
    shift_labels: bool
    text_inputs_only: bool = False  # a causal LM: samples carry input_ids (or inputs_embeds)
    encoder_decoder: bool = False  # labels are the target sequence, of their own length (T5, BART)

    @classmethod
    def of(cls, model: nn.Module, shift_labels: bool) -> ModelLimits:
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        if vocab is None and hasattr(model, "get_input_embeddings"):
            try:
                vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
            except (NotImplementedError, AttributeError):  # a model without input embeddings (a custom head)
                vocab = None
        classifier = "ForSequenceClassification" in type(model).__name__
        return cls(vocab_size=vocab, max_positions=getattr(config, "max_position_embeddings", None),
                   num_labels=getattr(config, "num_labels", None) if classifier else None,
                   shift_labels=shift_labels, text_inputs_only=shift_labels,
                   encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)))


def _int_list(value: Any, key: str) -> list[int]:
    """`value` as a flat list of ints, or a ValueError saying what it is instead."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(f"{key!r} is a {value.dim()}-D {value.dtype} tensor; it must be a 1-D integer tensor")
        return value.tolist()
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise ValueError(f"{key!r} is {type(value).__name__} {value!r:.60}; it must be a list of token ids "
                         "(tokenize the text first, or pass a data_collator that does)")
    out = list(value)
    for item in out:
        if isinstance(item, numbers.Integral) and not isinstance(item, bool):
            continue
        if hasattr(item, "__iter__") and not isinstance(item, str):
            raise ValueError(f"{key!r} is nested (a list of lists); each sample must be one flat list of ids")
        raise ValueError(f"{key!r} holds {type(item).__name__} {item!r:.40}; token ids must be ints")
    return [int(v) for v in out]


def _floats(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, float) for v in value)


def check_sample(sample: Any, limits: ModelLimits) -> tuple[str | None, int]:
    """(problem or None, number of target tokens) of one sample, as the default collator sees it."""
    if not isinstance(sample, dict):
        return f"is a {type(sample).__name__}, not a dict of fields (input_ids, labels, ...)", 0
    # features, pixels, audio, embeddings: the model's own inputs (a model without a vocabulary may call its
    # float features input_ids)
    if "input_ids" not in sample or (limits.vocab_size is None and not limits.text_inputs_only):
        return _check_non_token_sample(sample, limits)
    try:
        ids = _int_list(sample["input_ids"], "input_ids")
    except ValueError as err:
        return str(err), 0
    if not ids:
        return "has an empty 'input_ids'; drop empty samples", 0
    vocab, positions = limits.vocab_size, limits.max_positions
    low, high = min(ids), max(ids)
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        return (f"has token id {bad} in 'input_ids', outside the model's vocabulary [0, {vocab}); use the "
                "model's own tokenizer, or resize the embeddings"), 0
    if positions is not None and len(ids) > positions:
        return (f"has {len(ids)} tokens, more than the model's max_position_embeddings ({positions}); truncate "
                f"the samples to {positions} tokens"), 0
    labels = sample.get("labels", sample.get("label", ids))
    if isinstance(labels, int | float) or (isinstance(labels, torch.Tensor) and labels.dim() == 0):
        value = labels.item() if isinstance(labels, torch.Tensor) else labels
        if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
            return f"has label {value!r}; labels must be class ids (ints) or finite numbers", 0
        if isinstance(value, int) and limits.num_labels and not (0 <= value < limits.num_labels
                                                                   or value == IGNORE_INDEX):
            return f"has label {value}, outside the model's num_labels ({limits.num_labels})", 0
        return None, int(value != IGNORE_INDEX)
    if _floats(labels):  # one target vector per sample (multi-label, multi-output regression)
        if not all(math.isfinite(v) for v in labels):
            return f"has labels {labels!r:.60} that are not finite; drop or fix the sample", 0
        return None, 1
    try:
        labels = _int_list(labels, "labels")
    except ValueError as err:
        return str(err), 0
    if len(labels) != len(ids) and not limits.encoder_decoder:
        return f"has {len(labels)} labels for {len(ids)} input_ids; give one label per token (-100 to ignore)", 0
    bad_labels = [v for v in labels if v != IGNORE_INDEX and (v < 0 or (vocab is not None and v >= vocab))]
    if bad_labels:
        return f"has label {bad_labels[0]}, outside [0, {vocab}) and not -100 (ignored)", 0
    targets = labels[1:] if limits.shift_labels else labels
    return None, sum(v != IGNORE_INDEX for v in targets)


def _check_non_token_sample(sample: dict[str, Any], limits: ModelLimits) -> tuple[str | None, int]:
    """A sample without token ids: its label, if any, must be a class id or finite numbers (1 target)."""
    labels = sample.get("labels", sample.get("label", sample.get("label_ids")))
    if limits.text_inputs_only and "inputs_embeds" not in sample:
        return (f"has no 'input_ids' (fields: {sorted(sample)}); tokenize the dataset first, or pass a "
                "data_collator that builds input_ids"), 0
    if labels is None:
        return None, 1  # the model computes its loss from its inputs
    try:
        values = torch.as_tensor(labels, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return f"has labels {labels!r:.60} that are not numbers; labels must be class ids or numbers", 0
    if not torch.isfinite(values).all():
        return f"has labels {labels!r:.60} that are not finite; drop or fix the sample", 0
    return None, int((values != IGNORE_INDEX).any())


def validate_dataset(dataset: Any, *, name: str, limits: ModelLimits, check_samples: bool,
                     need_targets: bool, device: torch.device) -> None:
    """Collective: raise the same `DataError` on every rank when `dataset` cannot be used.

    Args:
        name: "train_dataset" or "eval_dataset" (used in messages).
        check_samples: check every sample (False with a custom data_collator: only emptiness).
        need_targets: at least one target token in the whole dataset (training).
    """
    if dataset is None or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(f"{name} must be a map-style dataset (a list, a datasets.Dataset, or any object with "
                        f"__len__ and __getitem__), got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise DataError(f"{name} is empty (0 samples); pass a dataset with at least one sample")
    if not check_samples:
        return
    rank, world = collectives.get_rank(), collectives.get_world_size()
    first: tuple[int, str] | None = None
    targets = 0
    for index in range(rank, len(dataset), world):
        try:
            sample = dataset[index]
        except Exception as err:  # the user's dataset: any error reading it is reported with its index
            problem, count = f"cannot be read ({type(err).__name__}: {err})", 0
        else:
            problem, count = check_sample(sample, limits)
        if problem is not None:
            first = (index, problem)
            break
        targets += count
    found = collectives.gather_objects((first, targets))
    problems = sorted(p for p, _ in found if p is not None)
    if problems:
        index, problem = problems[0]
        raise DataError(f"{name}[{index}] {problem}")
    if need_targets and sum(t for _, t in found) == 0:
        raise DataError(f"{name} has no target token: every label is -100 (or every sample has one token), so "
                        "there is nothing to learn; check how labels are built")


def writable_problem(directory: str | Path, what: str) -> str | None:
    """Why `directory` cannot be created and written to, or None when it can."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".shardtrain-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return (f"{what} {str(path)!r} is not writable ({err.strerror or err}); choose a directory you can write "
                "to")
    return None
