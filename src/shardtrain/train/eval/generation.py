"""`predict_with_generate` for causal language models: answers generated from prompts, as predictions.

    args = TrainingArguments(..., predict_with_generate=True)          # evaluate() / predict() generate
    output = trainer.predict(test_set)   # predictions: generated tokens; label_ids: the reference answers

A sample's prompt is its input up to the first labelled token (the tokens before the answer), its reference
answer the labelled tokens (labels != -100); a sample without labels is all prompt. Prompts of a batch are left
padded and generated together with `model.generate` (greedy unless `generation_num_beams` or the model's
generation config say otherwise), for at most the longest answer of the batch in new tokens (or up to
`generation_max_length` tokens in all, as Hugging Face's Seq2SeqTrainer). Predictions hold only the new tokens,
padded with -100, so `compute_metrics` compares them with the answers directly. Under FSDP every rank generates
(the model's weights are gathered in each forward); transformers' `synced_gpus` keeps ranks that finish early
stepping, and the placeholders of short data shares keep the number of `generate` calls equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtrain.errors import TrainingArgumentsError
from shardtrain.model_facts import IGNORE_INDEX


def prompts_and_answers(batch: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """Per row: the prompt (real tokens before the first label) and the answer (the labelled tokens)."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask", torch.ones_like(ids))
    labels = batch.get("labels")
    prompts, answers = [], []
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        if labels is None or not (labels[row] != IGNORE_INDEX).any():
            prompts.append(ids[row][real].tolist())
            answers.append([])
            continue
        targets = labels[row] != IGNORE_INDEX
        first = int(targets.nonzero()[0])
        prompts.append(ids[row, :first][real[:first]].tolist())
        answers.append(labels[row][targets].tolist())
    return prompts, answers


def generate_answers(model: nn.Module, batch: dict[str, torch.Tensor], *, pad_token_id: int,
                     stop_token_ids: set[int] = frozenset(), max_length: int | None = None,
                     num_beams: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(generated new tokens, reference answers) for every row of `batch` (every rank must call it).

    A row ends after its first stop token (kept: a reference answer usually ends with EOS), or else where only
    padding follows (the padding generate adds after a row has finished).
    """
    prompts, answers = prompts_and_answers(batch)
    device = batch["input_ids"].device
    width = max(len(p) for p in prompts) or 1
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, device=device)
            attention[row, width - len(prompt):] = 1
    kwargs: dict[str, Any] = {"pad_token_id": pad_token_id}
    if max_length is not None:
        kwargs["max_length"] = max_length
    else:
        kwargs["max_new_tokens"] = max(1, max(len(a) for a in answers))
    if num_beams is not None:
        kwargs["num_beams"] = num_beams
    with torch.no_grad():
        output = model.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
    generated = []
    for row in output[:, width:].tolist():
        stop = next((i for i, token in enumerate(row) if token in stop_token_ids), None)
        if stop is not None:
            row = row[:stop + 1]
        else:
            while row and row[-1] == pad_token_id:
                row.pop()
        generated.append(row)
    return generated, answers


def eval_generator(model: nn.Module, *, causal_lm: bool, max_length: int | None,
                   num_beams: int | None) -> Callable[[dict[str, torch.Tensor]], tuple[list, list]]:
    """`predict_with_generate`'s step: a collated batch -> (generated answers, reference answers), with the model's
    EOS tokens as stop tokens and its pad token (else its first EOS, as transformers) for padding.

    Raises:
        TrainingArgumentsError: `model` is not a causal language model with `generate()`.
    """
    if not causal_lm or not callable(getattr(model, "generate", None)):
        raise TrainingArgumentsError(f"predict_with_generate needs a causal language model with generate(); "
                                     f"{type(model).__name__} is not one; set predict_with_generate=False")
    config = getattr(model, "generation_config", None) or getattr(model, "config", None)
    eos = getattr(config, "eos_token_id", None)
    eos = list(eos) if isinstance(eos, list | tuple) else ([eos] if eos is not None else [])
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    stops = set(eos)

    def generate(batch: dict[str, torch.Tensor]) -> tuple[list, list]:
        return generate_answers(model, batch, pad_token_id=pad, stop_token_ids=stops, max_length=max_length,
                                num_beams=num_beams)
    return generate
