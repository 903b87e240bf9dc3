"""Padding-free packing of the plain Trainer (`pack_sequences=True`) against transformers' Trainer with its own
`DataCollatorWithFlattening`, on a tiny Llama with tied embeddings and documents of 3 to 12 tokens; global batch
8 samples per step (4 x accumulation 2 on one process).

    python packing.py hf OUT                          # transformers' Trainer, one process
    torchrun --nproc_per_node 2 packing.py ours OUT   # shardtrain: fsdp, fsdp unpacked, cp 2, tp 2

Writes OUT/<case>.json: per-step losses and gradient norms, the eval loss (ours; evaluation stays padded), and
for the packed fsdp case the first packed row's position_ids and the largest difference between the logits of
each of its documents and those of the document run alone.
"""

import json
import os
import sys
from pathlib import Path

import torch
from packed_rows import document_gap
from tiny_models import tiny_llama

MODE, OUT = sys.argv[1], Path(sys.argv[2])
WORLD, RANK = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def documents(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 64, (int(torch.randint(3, 13, (1,), generator=gen)),),
                                        generator=gen).tolist()} for _ in range(n)]


def history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}


COMMON = dict(max_steps=3, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to="none",
              seed=0, save_strategy="no", disable_tqdm=True, gradient_accumulation_steps=2,
              per_device_eval_batch_size=4)


def hf() -> None:
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(OUT / "run"), use_cpu=True, per_device_train_batch_size=4, **COMMON)
    trainer = Trainer(tiny_llama(tie=True), args, train_dataset=documents(32, 1),
                      data_collator=DataCollatorWithFlattening(return_position_ids=True, separator_id=-100))
    trainer.train()
    (OUT / "packed.json").write_text(json.dumps(history(trainer)))


def ours() -> None:
    from shardtrain import Trainer, TrainingArguments, destroy_distributed

    per_rank = 4 // WORLD
    cases = {"packed": dict(per_device_train_batch_size=per_rank, pack_sequences=True),
             "padded": dict(per_device_train_batch_size=per_rank),
             "packed_cp": dict(per_device_train_batch_size=4, pack_sequences=True, cp_size=WORLD),
             "packed_tp": dict(per_device_train_batch_size=4, pack_sequences=True, tp_size=WORLD)}
    for name, fields in cases.items():
        args = TrainingArguments(output_dir=str(OUT / name), fsdp=True, **COMMON, **fields)
        trainer = Trainer(tiny_llama(tie=True), args, train_dataset=documents(32, 1), eval_dataset=documents(10, 2))
        result = {}
        if name == "packed":
            result["position_ids"], result["document_gap"] = document_gap(trainer.model,
                                                                          trainer.data_collator(documents(4, 9)))
        trainer.train()
        result.update(history(trainer), eval_loss=trainer.evaluate()["eval_loss"])
        if RANK == 0:
            (OUT / f"{name}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    hf() if MODE == "hf" else ours()
