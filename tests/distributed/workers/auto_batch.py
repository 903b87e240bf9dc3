"""auto_find_batch_size: a run whose micro-batches of more than half the per-device batch "run out of memory" (a
training_step that raises torch's OutOfMemoryError for them, as a device would) against the same run that never
had to: its batch is halved once and its accumulation steps doubled.

    python auto_batch.py plain|forced OUT.json            (one process)
    torchrun --nproc_per_node 2 auto_batch.py plain|forced OUT.json

GPT-2 with tied embeddings and padded samples (dropout off: a different micro-batch split draws other dropout
masks); global batch 8, 6 steps. Writes the per-step losses,
gradient norms, the per-device batch the run ended with and the micro-batch sizes it trained on.
"""

import json
import os
import sys

import torch
from tiny_models import tiny_gpt2, variable_length_dataset

import shardtrain

MODE, OUT = sys.argv[1], sys.argv[2]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


class Forced(shardtrain.Trainer):
    sizes: list[int] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        rows = inputs["input_ids"].shape[0]
        if rows > 8 // WORLD // 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (forced by the test)")
        self.sizes.append(rows)
        return super().training_step(model, inputs, num_items_in_batch)


def main() -> None:
    trainer_cls = Forced if MODE == "forced" else shardtrain.Trainer
    args = shardtrain.TrainingArguments(
        f"{OUT}.run", per_device_train_batch_size=8 // WORLD, max_steps=6, logging_steps=1, learning_rate=1e-2,
        report_to=[], disable_tqdm=True, save_strategy="no", seed=3, auto_find_batch_size=MODE == "forced",
        **({"fsdp": "full_shard"} if WORLD > 1 else {}))
    trainer = trainer_cls(model=tiny_gpt2(dropout=0.0), args=args, train_dataset=variable_length_dataset(48))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(OUT, "w") as f:
            json.dump({"losses": [e["loss"] for e in logs], "grad_norms": [e["grad_norm"] for e in logs],
                       "train_batch_size": trainer._train_batch_size, "state_batch": trainer.state.train_batch_size,
                       "sizes": sorted(set(getattr(trainer_cls, "sizes", [])))}, f)
    shardtrain.destroy_distributed()


if __name__ == "__main__":
    main()
