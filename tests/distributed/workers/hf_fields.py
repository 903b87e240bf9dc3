"""Hugging Face fields that change what is trained or evaluated: label_smoothing_factor (classifier and causal
LM), optim sgd / rmsprop, neftune_noise_alpha, batch_eval_metrics, include_for_metrics ["inputs"], under
shardtrain's Trainer or transformers' (one process).

    python hf_fields.py hf OUT                    # transformers.Trainer
    python hf_fields.py ours OUT                  # shardtrain.Trainer, one process
    torchrun --nproc_per_node 2 hf_fields.py ours OUT

Each case trains 3 steps on 8 equal-length samples (global batch 8; transformers' run takes them in one batch,
so its sampler's order does not matter) and evaluates. Writes OUT/<case>.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
from tiny_models import tiny_llama
from transformers import BertConfig, BertForSequenceClassification

N = 8
CASES = {"smooth_cls": {"label_smoothing_factor": 0.1}, "smooth_lm": {"label_smoothing_factor": 0.1},
         "sgd": {"optim": "sgd"}, "rmsprop": {"optim": "rmsprop", "learning_rate": 1e-3},
         "neftune": {"neftune_noise_alpha": 5.0}, "plain": {}, "batch_metrics": {"batch_eval_metrics": True},
         "inputs_metrics": {"include_for_metrics": ["inputs"]}}
HF_CASES = ("smooth_cls", "smooth_lm", "sgd", "rmsprop", "batch_metrics", "inputs_metrics")


class BatchAccuracy:
    """A compute_metrics for batch_eval_metrics: accumulates over batches, returns at compute_result."""

    def __init__(self) -> None:
        self.correct = self.rows = self.calls = 0
        self.tensors = True

    def __call__(self, prediction, compute_result: bool) -> dict:
        preds, labels = prediction.predictions, prediction.label_ids
        self.tensors &= isinstance(preds, torch.Tensor) and isinstance(labels, torch.Tensor)
        self.correct += int((preds.argmax(-1) == labels).sum())
        self.rows += len(labels)
        self.calls += 1
        if not compute_result:
            return {}
        out = {"accuracy": self.correct / self.rows, "rows": self.rows, "tensors": float(self.tensors)}
        self.correct = self.rows = 0
        return out


def input_digest(prediction) -> dict:
    """include_for_metrics ["inputs"]: the rows of EvalPrediction.inputs (their tokens, in order; padding of any
    kind dropped: real tokens are >= 3), and the predictions' argmax checked against the same rows."""
    inputs = torch.as_tensor(prediction.inputs)
    real = [row[row >= 3] for row in inputs]
    return {"input_rows": float(inputs.shape[0]), "input_tokens": float(sum(len(row) for row in real)),
            # each row's tokens weighted by position and row: equal only for the same rows in the same order
            "input_sums": float(sum((i + 1) * (row * torch.arange(1, len(row) + 1)).sum()
                                    for i, row in enumerate(real)))}


def pad_collator(rows: list[dict]) -> dict:
    """Pads input_ids and attention_mask with 0 to the batch's longest row (the same collator for both trainers)."""
    longest = max(len(row["input_ids"]) for row in rows)
    pad = lambda values: [*values, *[0] * (longest - len(values))]  # noqa: E731
    return {"input_ids": torch.tensor([pad(row["input_ids"]) for row in rows]),
            "attention_mask": torch.tensor([pad(row["attention_mask"]) for row in rows]),
            "labels": torch.tensor([row["labels"] for row in rows])}


def case(name: str) -> tuple[torch.nn.Module, list, list]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "smooth_lm":
        ids = torch.randint(1, 64, (N + 4, 8), generator=gen)
        rows = [{"input_ids": r.tolist(), "attention_mask": [1] * 8, "labels": r.tolist()} for r in ids]
        return tiny_llama(), rows[:N], rows[N:]
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0))
    ids = torch.randint(3, 60, (N + (12 if name == "batch_metrics" else 4), 6), generator=gen)
    rows = [{"input_ids": r.tolist(), "attention_mask": [1] * 6, "labels": int(r[0]) % 3} for r in ids]
    if name == "inputs_metrics":  # eval rows of 3-6 tokens: batches padded to their longest
        rows[N:] = [{**row, "input_ids": row["input_ids"][:3 + i % 4], "attention_mask": [1] * (3 + i % 4)}
                    for i, row in enumerate(rows[N:])]
    return model, rows[:N], rows[N:]


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if which == "ours":
        from shardtrain import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    for name, fields in CASES.items():
        if which == "hf" and name not in HF_CASES:
            continue
        model, train, evaluation = case(name)
        batch = dict(per_device_train_batch_size=N // world // 2, gradient_accumulation_steps=2, fsdp=True) if \
            which == "ours" else dict(per_device_train_batch_size=N)
        args = TrainingArguments(str(out / name), max_steps=3, per_device_eval_batch_size=4, logging_steps=1,
                                 save_strategy="no", report_to="none", disable_tqdm=True, seed=3, use_cpu=True,
                                 **{"learning_rate": 0.05, **fields, **batch})
        metrics_fn = BatchAccuracy() if name == "batch_metrics" else input_digest if name == "inputs_metrics" else None
        collator = pad_collator if name == "inputs_metrics" else None
        trainer = Trainer(model, args, train_dataset=train, eval_dataset=evaluation, compute_metrics=metrics_fn,
                          data_collator=collator)
        trainer.train()
        metrics = trainer.evaluate()
        embeddings = trainer.model.get_input_embeddings()
        if int(os.environ.get("RANK", "0")) == 0:
            (out / f"{name}.json").write_text(json.dumps({
                "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                "eval_loss": metrics["eval_loss"], "hooks_left": len(embeddings._forward_hooks),
                "accuracy": metrics.get("eval_accuracy"), "rows": metrics.get("eval_rows"),
                "tensors": metrics.get("eval_tensors"),
                **{key: metrics.get(f"eval_{key}") for key in ("input_rows", "input_tokens", "input_sums")},
                "optimizer": type(trainer.optimizer).__name__}))


if __name__ == "__main__":
    main()
