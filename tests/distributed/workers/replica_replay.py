"""One process trains the tiny Llama on exactly the samples a replica-group run committed, step by step.

python replica_replay.py '{"out": "OUT", "record": "RUN/committed_batches.jsonl", "max_steps": 40}'
Each line of the record is one step's batch (its groups' samples together); OUT/weights.pt is the final model.
"""

import json
import sys
from pathlib import Path

import torch
from tiny_models import tiny_llama, variable_length_dataset
from torch.utils.data import DataLoader

from shardtrain import Trainer, TrainingArguments
from shardtrain.parallel.states import full_model_state


class Replay(Trainer):
    batches: list[list[int]] = []

    def get_train_dataloader(self):
        return DataLoader(self.train_dataset, batch_sampler=self.batches, collate_fn=self.data_collator)


def main(job: dict) -> None:
    out = Path(job.pop("out"))
    record = [json.loads(line) for line in Path(job.pop("record")).read_text().splitlines()]
    Replay.batches = [line["samples"] for line in record]
    data = variable_length_dataset(n=job.pop("dataset_size", 96), vocab=64)
    defaults = {"learning_rate": 1e-2, "weight_decay": 0.1, "logging_steps": 1, "fsdp": True,
                "save_strategy": "no", "warmup_steps": 2, "disable_tqdm": True, "max_grad_norm": 1.0,
                "per_device_train_batch_size": 8}
    args = TrainingArguments(output_dir=str(out), **{**defaults, **job})
    trainer = Replay(tiny_llama(seed=0, tie=True), args, train_dataset=data)
    trainer.train()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(full_model_state(trainer.model), out / "weights.pt")
    losses = [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e]
    (out / "result.json").write_text(json.dumps({"steps": losses}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
