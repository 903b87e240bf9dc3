"""`Trainer.hyperparameter_search` (optuna, Hugging Face's backend) with a `model_init`, on shardtrain's Trainer
(one process or several ranks) or on transformers' own (one process).

    python hp_search.py ours|hf OUT_DIR           # writes OUT_DIR/result-<rank>.json
    torchrun --nproc_per_node 2 hp_search.py ours OUT_DIR

Four trials over learning_rate, weight_decay and max_steps, a seeded TPE sampler and a median pruner, evaluated
every 2 steps, a checkpoint every 4. Writes the best run, every trial (state, parameters, value, intermediate
values), every objective this rank computed, the model_init calls and the checkpoints left in OUT_DIR.
"""

import json
import os
import sys
from pathlib import Path

import optuna
import torch
from transformers import BertConfig, BertForSequenceClassification

RANKS = int(os.environ.get("WORLD_SIZE", "1"))


def data(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    ids = torch.randint(10, 50, (n, 8), generator=gen) + 40 * labels[:, None]
    return [{"input_ids": ids[i].tolist(), "attention_mask": [1] * 8, "labels": int(labels[i])} for i in range(n)]


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    inits = []

    def model_init(trial):  # Hugging Face's signature with the trial (None outside a search)
        inits.append(None if trial is None else dict(trial.params))
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, classifier_dropout=0.0, num_labels=2, pad_token_id=0)
        return BertForSequenceClassification(config)

    def hp_space(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
                "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1),
                "max_steps": trial.suggest_int("max_steps", 4, 8)}

    objectives = []

    def compute_objective(metrics):
        objectives.append(metrics["eval_loss"])
        return metrics["eval_loss"]

    common = dict(output_dir=str(out), per_device_train_batch_size=8 // RANKS, per_device_eval_batch_size=8,
                  eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=4, logging_steps=2,
                  report_to=[], disable_tqdm=True, seed=0, use_cpu=True)
    if which == "ours":
        from shardtrain import Trainer, TrainingArguments

        args = TrainingArguments(fsdp="full_shard", **common)
    else:
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(**common)
    trainer = Trainer(model_init=model_init, args=args, train_dataset=data(32, 1), eval_dataset=data(16, 2))
    storage = optuna.storages.InMemoryStorage()
    best = trainer.hyperparameter_search(
        hp_space=hp_space, compute_objective=compute_objective, n_trials=4, direction="minimize",
        backend="optuna", sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1), storage=storage, study_name="search")
    rank = int(os.environ.get("RANK", "0"))
    result = {"objectives": objectives, "inits": inits}
    if rank == 0:
        study = optuna.load_study(study_name="search", storage=storage)
        result.update(
            best=[best.run_id, best.objective, best.hyperparameters],
            trials=[{"state": t.state.name, "params": t.params, "value": t.value,
                     "intermediate": {str(k): v for k, v in t.intermediate_values.items()}} for t in study.trials],
            checkpoints=sorted(str(p.relative_to(out)) for p in out.glob("run-*/checkpoint-*")))
    (out / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
