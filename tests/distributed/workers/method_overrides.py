"""A library-style Trainer subclass overriding the methods that `hf_methods` says the engine honours.

    torchrun --nproc_per_node 2 method_overrides.py hf|ours OUT

`_get_train_sampler` and `_get_eval_sampler` give the samples in reverse order, `_save` writes a file of its own,
`_load_optimizer_and_scheduler` reads one back on resume (as GRPO's does). The subclass of transformers' Trainer
("hf") and the same subclass on shardtrain's engine ("ours") train 2 steps of a tiny Llama on 8 rows whose first
token is their index + 1, on 2 processes. A second subclass overrides `get_train_dataloader` (each rank its own
rows) and `get_resumed_dataloader` (transformers >= 5.25: it returns the loader as it is, as one that keeps its own
position would), trains the 4 steps of an epoch and resumes from step 2. Writes OUT/rank<R>.json: the first tokens
of every micro-batch this rank trained on, the rows predict() returned, how often each override ran, and the
resumed run's micro-batches and get_resumed_dataloader's num_batches.
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from tiny_models import tiny_llama
from torch.utils.data import DataLoader, Sampler

MODE, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ.get("RANK", "0"))


class Reversed(Sampler):
    def __init__(self, dataset) -> None:
        self.n = len(dataset)

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def with_overrides(base: type) -> type:
    class LibraryTrainer(base):
        counts: dict[str, int] = {}
        seen: list[list[int]] = []

        def _count(self, name: str) -> None:
            self.counts[name] = self.counts.get(name, 0) + 1

        def _get_train_sampler(self, train_dataset=None):
            self._count("_get_train_sampler")
            return Reversed(train_dataset if train_dataset is not None else self.train_dataset)

        def _get_eval_sampler(self, eval_dataset):
            self._count("_get_eval_sampler")
            return Reversed(eval_dataset)

        def _save(self, output_dir=None, state_dict=None):
            self._count("_save")
            super()._save(output_dir, state_dict)  # transformers' own: save_pretrained of the model
            os.makedirs(output_dir, exist_ok=True)
            weight = self.model.get_input_embeddings().weight  # whole, not a shard, on the saving process
            Path(output_dir, "library_file.json").write_text(json.dumps({"embedding_shape": list(weight.shape)}))

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            self._count("_load_optimizer_and_scheduler")
            if checkpoint is not None:
                self.extra = json.loads(Path(checkpoint, "extra_state.json").read_text())

        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            folder = Path(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
            if self.is_world_process_zero():
                (folder / "extra_state.json").write_text(json.dumps({"step": self.state.global_step}))

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen.append(inputs["input_ids"][:, 0].tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    return LibraryTrainer


class RankRows(Sampler):
    """This rank's rows (every second one), in order."""

    def __init__(self, dataset) -> None:
        self.rows = list(range(RANK, len(dataset), 2))

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def with_loader(base: type) -> type:
    class LoaderTrainer(base):
        resumed_calls: list[int] = []
        seen: list[list[int]] = []

        def get_train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=2, sampler=RankRows(self.train_dataset),
                              collate_fn=transformers.default_data_collator)

        def get_resumed_dataloader(self, dataloader, num_batches):
            self.resumed_calls.append(num_batches)
            return dataloader  # a loader that keeps its own position would: no batch skipped here

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen.append(inputs["input_ids"][:, 0].tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    return LoaderTrainer


def resumed_loader(trainer_cls: type, args_cls: type, common: dict) -> dict:
    """The 4 steps of an epoch, then a resume from checkpoint-2: the micro-batches before and after it, and the
    calls of get_resumed_dataloader."""
    rows = [{"input_ids": [i + 1, 9, 10, 11], "labels": [i + 1, 9, 10, 11]} for i in range(16)]
    common = {**common, "max_steps": 4}
    trainer_cls(model=tiny_llama(), args=args_cls(str(OUT / "loader"), **common), train_dataset=rows).train()
    trained = len(trainer_cls.seen)
    resumed = trainer_cls(model=tiny_llama(), args=args_cls(str(OUT / "loader_resumed"), **common),
                          train_dataset=rows)
    resumed.train(resume_from_checkpoint=str(OUT / "loader" / "checkpoint-2"))
    return {"trained": trainer_cls.seen[:trained], "resumed": trainer_cls.seen[trained:],
            "resumed_calls": trainer_cls.resumed_calls}


def main() -> None:
    rows = [{"input_ids": [i + 1, 9, 10, 11], "labels": [i + 1, 9, 10, 11]} for i in range(8)]
    if MODE == "hf":
        trainer_cls, args_cls, extra = with_overrides(transformers.Trainer), transformers.TrainingArguments, {}
    else:
        import shardtrain

        trainer_cls, args_cls = with_overrides(shardtrain.Trainer), shardtrain.TrainingArguments
        extra = {"fsdp": "full_shard"}
    common = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=2, save_steps=1,
                  report_to=[], disable_tqdm=True, use_cpu=True, logging_steps=1, **extra)
    trainer = trainer_cls(model=tiny_llama(), args=args_cls(str(OUT / "run"), **common), train_dataset=rows)
    trainer.train()
    trainer.save_model(str(OUT / "saved"))
    predictions = trainer.predict(rows)
    first = predictions.label_ids[:, 0].tolist()
    seen = list(trainer_cls.seen)
    resumed = trainer_cls(model=tiny_llama(), args=args_cls(str(OUT / "resumed"), **{**common, "max_steps": 2}),
                          train_dataset=rows)
    resumed.train(resume_from_checkpoint=str(OUT / "run" / "checkpoint-1"))
    loader = resumed_loader(with_loader(transformers.Trainer if MODE == "hf" else shardtrain.Trainer), args_cls,
                            common)
    OUT.mkdir(parents=True, exist_ok=True)
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(OUT / "saved"))
    (OUT / f"rank{RANK}.json").write_text(json.dumps({
        "saved_embedding_sum": float(saved.get_input_embeddings().weight.sum()),
        "seen": seen, "counts": trainer_cls.counts, "predicted_rows": first,
        "extra": getattr(resumed, "extra", None), "loader": loader,
        "library_file": json.loads((OUT / "saved" / "library_file.json").read_text())}))
    if MODE == "ours":
        shardtrain.destroy_distributed()
    elif torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
