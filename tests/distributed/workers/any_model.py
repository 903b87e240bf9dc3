"""Models that are not token language models, trained by shardtrain's Trainer or by transformers' own.

    python any_model.py hf OUT                 # transformers.Trainer, one process
    python any_model.py ours OUT               # shardtrain.Trainer, one process
    torchrun --nproc_per_node 2 any_model.py ours OUT

Cases: a regression model without embeddings on float features (MSE), a plain module returning tuples, a tiny
ViT on `pixel_values`, a multi-label BERT (float label vectors, BCE), a siamese model with a cosine loss on
two float inputs (custom inputs and loss), and the regression model with dropout (resume only). Every case
trains 4 steps on 16 samples (global batch 16), evaluates and predicts; ours also resumes from checkpoint-2.
Writes OUT/<case>.json (losses, eval loss, predictions, whether the resume was bit-identical) and
OUT/<case>.pt (final weights, rank 0).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    ViTConfig,
    ViTForImageClassification,
)
from transformers.modeling_outputs import SequenceClassifierOutput

N, STEPS = 16, 4


class RegressorConfig(PretrainedConfig):
    model_type = "tiny-regressor"

    def __init__(self, features: int = 6, hidden: int = 16, dropout: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.features, self.hidden, self.dropout = features, hidden, dropout


class Regressor(PreTrainedModel):
    """No input embeddings: float `features` in, one number out, its own MSE loss."""

    config_class = RegressorConfig

    def __init__(self, config: RegressorConfig) -> None:
        super().__init__(config)
        self.net = nn.Sequential(nn.Linear(config.features, config.hidden), nn.Tanh(), nn.Dropout(config.dropout),
                                 nn.Linear(config.hidden, 1))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        predictions = self.net(features).squeeze(-1)
        loss = F.mse_loss(predictions, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=predictions)


class Siamese(PreTrainedModel):
    """Two float inputs `a` and `b`, one encoder, a cosine-similarity regression loss (sentence-transformers'
    CosineSimilarityLoss)."""

    config_class = RegressorConfig

    def __init__(self, config: RegressorConfig) -> None:
        super().__init__(config)
        self.encoder = nn.Sequential(nn.Linear(config.features, config.hidden), nn.Tanh(),
                                     nn.Linear(config.hidden, config.hidden))

    def forward(self, a: torch.Tensor, b: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        similarity = F.cosine_similarity(self.encoder(a), self.encoder(b), dim=-1)
        out = {"similarity": similarity}
        if labels is not None:
            out = {"loss": F.mse_loss(similarity, labels), **out}
        return out


class TupleNet(nn.Module):
    """A plain module (not a PreTrainedModel) that returns (loss, logits) with labels and (logits,) without."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> tuple:
        logits = self.head(torch.relu(self.hidden(features)))
        return (logits,) if labels is None else (F.cross_entropy(logits, labels), logits)


def _features(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, 6, generator=gen)


def case(name: str, seed: int = 0) -> tuple[nn.Module, list, list]:
    """(model, train set, eval set) of a case; the same in every process."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def rows(n: int) -> list[dict]:
        if name in ("regression", "regression_dropout"):
            x = _features(gen, n)
            return [{"features": x[i].tolist(), "labels": float(x[i].sum() * 0.5)} for i in range(n)]
        if name == "tuple":
            x = _features(gen, n)
            return [{"features": x[i].tolist(), "labels": int(x[i, 0] > 0) + int(x[i, 1] > 0)} for i in range(n)]
        if name == "vit":
            x = torch.rand(n, 3, 8, 8, generator=gen)
            return [{"pixel_values": x[i], "labels": int(x[i].mean() * 30) % 3} for i in range(n)]
        if name == "multilabel":
            ids = torch.randint(3, 60, (n, 6), generator=gen)
            return [{"input_ids": ids[i].tolist(), "attention_mask": [1] * 6,
                     "labels": [float(ids[i, 0] > 30), float(ids[i, 1] > 30), float(ids[i].sum() > 180)]}
                    for i in range(n)]
        a, b = _features(gen, n), _features(gen, n)
        return [{"a": a[i].tolist(), "b": b[i].tolist(), "labels": float(torch.tanh(a[i, 0] * b[i, 0]))}
                for i in range(n)]

    train, evaluation = rows(N), rows(8)
    if name in ("regression", "regression_dropout"):
        model = Regressor(RegressorConfig(dropout=0.2 if name == "regression_dropout" else 0.0))
    elif name == "tuple":
        model = TupleNet()
    elif name == "vit":
        model = ViTForImageClassification(ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    elif name == "multilabel":
        model = BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, num_labels=3, problem_type="multi_label_classification",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0))
    else:
        model = Siamese(RegressorConfig())
    return model, train, evaluation


CASES = ("regression", "tuple", "vit", "multilabel", "siamese", "regression_dropout")
HF_CASES = CASES[:-1]


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls it (gathers DTensor shards)."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = value.detach().cpu().clone()
    return out


def arguments(cls, out: Path, world: int, **extra):
    per_device = N // world // 2
    return cls(str(out), max_steps=STEPS, per_device_train_batch_size=per_device, gradient_accumulation_steps=2,
               per_device_eval_batch_size=4, learning_rate=0.05, logging_steps=1, save_strategy="steps",
               save_steps=2, report_to="none", disable_tqdm=True, seed=3, **extra)


def run_ours(out: Path) -> None:
    from shardtrain import Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    for name in CASES:
        model, train, evaluation = case(name)
        args = arguments(TrainingArguments, out / name, world, fsdp=True)
        trainer = Trainer(model, args, train_dataset=train, eval_dataset=evaluation)
        result = trainer.train()
        metrics = trainer.evaluate()
        predictions = trainer.predict(evaluation)
        final = full_weights(trainer.model)
        # resume from the middle: a new Trainer on a fresh model of the same case
        model, train, evaluation = case(name)
        resumed = Trainer(model, arguments(TrainingArguments, out / name, world, fsdp=True),
                          train_dataset=train, eval_dataset=evaluation)
        resumed.train(resume_from_checkpoint=str(out / name / "checkpoint-2"))
        again = full_weights(resumed.model)
        if rank == 0:
            torch.save(final, out / f"{name}.pt")
            (out / f"{name}.json").write_text(json.dumps({
                "training_loss": result.training_loss,
                "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                "eval_loss": metrics["eval_loss"], "test_loss": predictions.metrics.get("test_loss"),
                "predictions": predictions.predictions.tolist(),
                "resume_identical": all(torch.equal(final[k], again[k]) for k in final),
                "changed": max(float((final[k] - case(name)[0].state_dict()[k]).abs().max()) for k in final),
            }))


def run_hf(out: Path) -> None:
    from transformers import Trainer, TrainingArguments

    for name in HF_CASES:
        model, train, evaluation = case(name)
        # the whole set in one batch per step: the sampler's order (which differs from ours) does not matter
        args = TrainingArguments(str(out / name), max_steps=STEPS, per_device_train_batch_size=N,
                                 per_device_eval_batch_size=4, learning_rate=0.05, logging_steps=1,
                                 save_strategy="no", report_to="none", disable_tqdm=True, seed=3, use_cpu=True)
        trainer = Trainer(model, args, train_dataset=train, eval_dataset=evaluation)
        result = trainer.train()
        metrics = trainer.evaluate()
        predictions = trainer.predict(evaluation)
        preds = predictions.predictions
        preds = preds[0] if isinstance(preds, tuple) else preds
        (out / f"{name}.json").write_text(json.dumps({
            "training_loss": result.training_loss,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "eval_loss": metrics["eval_loss"], "test_loss": predictions.metrics.get("test_loss"),
            "predictions": preds.tolist()}))


if __name__ == "__main__":
    which, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    run_ours(out) if which == "ours" else run_hf(out)
