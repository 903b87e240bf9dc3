"""A `get_train_dataloader` override that returns a loader without a length (a DataLoader over an
IterableDataset, as TRL's GRPO builds on a streamed dataset): variable-length samples in batches of 4, 6 steps of
2 micro-batches, the loader read again after each pass. Two cases: 16 samples (passes of 2 full steps) and 20
(each pass ends on a short step of one micro-batch).

    python lengthless_loader.py hf OUT            # transformers.Trainer, one process
    python lengthless_loader.py ours OUT          # shardtrain: the runs, then a resume from checkpoint-4
    torchrun --nproc_per_node 2 lengthless_loader.py uneven OUT   # rank 1's loader runs out first: refused

Writes OUT/<mode>.json: per case, the per-step losses; transformers' also with a loader of the same batches
that has a length (`sized20`); ours also the position saved with the run and whether the resume gave the same
losses and bit-identical weights.
"""

import json
import os
import sys
from pathlib import Path

import torch
from streaming import Stream, collate
from tiny_models import tiny_llama, variable_length_dataset
from torch.utils.data import DataLoader

MODE, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ.get("RANK", 0))


def run(lib, name: str, count: int, sized: bool = False, resume: str | None = None) -> dict:
    samples = variable_length_dataset(count)[:count - 8 if MODE == "uneven" and RANK == 1 else count]

    class LoaderTrainer(lib.Trainer):
        def get_train_dataloader(self):
            return DataLoader(samples if sized else Stream(samples), batch_size=4, collate_fn=collate)

    args = lib.TrainingArguments(output_dir=str(OUT / name), per_device_train_batch_size=4, max_steps=6,
                                 gradient_accumulation_steps=2, learning_rate=1e-2, lr_scheduler_type="constant",
                                 logging_steps=1, report_to="none", disable_tqdm=True, seed=0,
                                 save_strategy="no" if MODE == "hf" else "steps", save_steps=2, use_cpu=True)
    trainer = LoaderTrainer(tiny_llama(), args, train_dataset=Stream(samples), data_collator=collate)
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    if MODE == "hf":
        return {"losses": losses}
    from shardtrain.parallel.states import full_model_state

    return {"losses": losses, "position": [trainer.state.data_epoch, trainer.state.data_step],
            "weights": full_model_state(trainer.model)}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if MODE == "hf":
        import transformers

        result = {"even16": run(transformers, "even16", 16), "short20": run(transformers, "short20", 20),
                  "sized20": run(transformers, "sized20", 20, sized=True)}
    else:
        import shardtrain

        result = {}
        for count in (16, 20) if MODE == "ours" else (20,):
            name = f"{'even' if count == 16 else 'short'}{count}"
            result[name] = case = run(shardtrain, name, count)
            resumed = run(shardtrain, f"{name}_resumed", count, resume=str(OUT / name / "checkpoint-4"))
            full_weights, weights = case.pop("weights"), resumed.pop("weights")
            case["resumed_losses"] = resumed["losses"]
            case["resume_identical"] = all(torch.equal(weights[k], full_weights[k]) for k in full_weights)
    if RANK == 0:
        (OUT / f"{MODE}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
