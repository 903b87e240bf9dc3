"""Step-guard runs: a tiny Llama on padded samples in their dataset order (a SequentialSampler, so removing a
batch's samples leaves the later batches as they were), whose loss turns NaN (or 100x, a spike) on every
micro-batch that holds a poisoned sample (its embeddings NaN, or the micro-batch's loss x 100); jobs come as JSON
and run one after the other.

    torchrun --nproc_per_node 2 step_guard.py '[{"out": "OUT", "poison": [27], "kind": "nan", "step_guard": true}]'

Job keys: "out", "poison" (sample indices), "kind" (nan | spike), "remove" (sample indices left out of the
dataset: the reference run), "cp" / "tp" (cp_size / tp_size 2: one data rank of 4 samples), "ep" (a tiny
Qwen3-MoE, ep_size 2), "pack" (pack_sequences), "stream" (the samples as an IterableDataset), "step_guard",
"max_steps", "save_steps", "stop_after" (a callback stops the run after that step), "resume" (a checkpoint path).
The global batch is 8 samples on any number of ranks (accumulation 2). Rank 0 writes OUT/result.json (losses,
skips, how many micro-batches with a poisoned sample reached the model on all ranks) and OUT/weights.pt (the final
weights, whole).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import tiny_llama, tiny_qwen3_moe, variable_length_dataset
from torch.utils.data import SequentialSampler

from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed
from shardtrain.parallel.states import full_model_state

POISON = 63  # a token id the data below never holds otherwise


class SequentialTrainer(Trainer):
    def _get_train_sampler(self, dataset=None):
        return SequentialSampler(dataset if dataset is not None else self.train_dataset)


class SpikeTrainer(SequentialTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = out[0] if return_outputs else out
        if (inputs["input_ids"] == POISON).any():
            loss = loss * 100.0
        return (loss, out[1]) if return_outputs else loss


SEEN = [0]  # micro-batches with a poisoned sample that reached the model, on this rank


def poison_embeddings(model, kind: str):
    """NaN embeddings for a poisoned token (a NaN loss and gradients, under any layout, cp included)."""
    def hook(module, args, output):
        if (args[0] == POISON).any():
            SEEN[0] += 1
            return output * float("nan") if kind == "nan" else output
        return output

    model.model.embed_tokens.register_forward_hook(hook)
    return model


class StopAfter(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def dataset(poison: list[int], remove: list[int]) -> list[dict]:
    rows = []
    for index, row in enumerate(variable_length_dataset(n=64, vocab=63)):  # ids 1..62
        ids = list(row["input_ids"])
        if index in poison:
            ids[1] = POISON
        if index not in remove:
            rows.append({"input_ids": ids})
    return rows


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def run(job: dict) -> None:
    out = Path(job["out"])
    SEEN[0] = 0
    rows = dataset(job.get("poison", []), job.get("remove", []))
    data_ranks = int(os.environ.get("WORLD_SIZE", "1"))
    layout = {"per_device_train_batch_size": 4, **({"cp_size": 2} if job.get("cp") else {"tp_size": 2})} \
        if job.get("cp") or job.get("tp") else {"per_device_train_batch_size": 8 // (2 * data_ranks)}
    args = TrainingArguments(output_dir=str(out), gradient_accumulation_steps=2, **layout,
                             pack_sequences=job.get("pack", False), ep_size=2 if job.get("ep") else None,
                             max_steps=job.get("max_steps", 5), learning_rate=1e-2, lr_scheduler_type="constant",
                             logging_steps=1, report_to="none", seed=0, fsdp=True,
                             save_strategy="steps" if job.get("save_steps") else "no",
                             save_steps=job.get("save_steps") or 500, step_guard=job.get("step_guard"))
    kind = job.get("kind", "nan")
    trainer_class = SpikeTrainer if kind == "spike" else SequentialTrainer
    model = tiny_qwen3_moe() if job.get("ep") else tiny_llama()
    trainer = trainer_class(poison_embeddings(model, kind), args,
                            train_dataset=Stream(rows) if job.get("stream") else rows,
                            callbacks=[StopAfter(job["stop_after"])] if job.get("stop_after") else None)
    trainer.train(resume_from_checkpoint=job.get("resume"))
    seen = torch.tensor([SEEN[0]])
    dist.all_reduce(seen)
    weights = full_model_state(trainer.model)
    if dist.get_rank() == 0:
        torch.save(weights, out / "weights.pt")
        logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
        (out / "result.json").write_text(json.dumps({
            "losses": [e["loss"] for e in logs], "global_step": trainer.state.global_step,
            "skipped_steps": trainer.state.skipped_steps, "skipped_batches": trainer.state.skipped_batches,
            "poison_seen": int(seen.item())}))


if __name__ == "__main__":
    for job in json.loads(sys.argv[1]):
        run(job)
    destroy_distributed()
