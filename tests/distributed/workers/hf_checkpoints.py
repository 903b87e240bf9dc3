"""Checkpoints that move between transformers' Trainer and shardtrain's.

python hf_checkpoints.py hf|ours OUT [RESUME [half]] (ours also under torchrun: FSDP on every rank; its
checkpoints' layout from STATE_DICT_TYPE, FULL_STATE_DICT by default)
A tiny Llama with tied embeddings, trained on one full batch (8 samples: the data order cannot matter) for 8
steps with a checkpoint every 4; with RESUME, `train(resume_from_checkpoint=RESUME)` ("half": with half the global
batch). Writes OUT/final (the model
as `save_model` writes it) and OUT/result.json (the per-step losses and learning rates, the steps it ran).
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from tiny_models import tiny_llama

SAMPLES, STEPS = 8, 8


def dataset() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(1, 64, (SAMPLES, 10), generator=gen)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in rows]


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    resume = sys.argv[3] if len(sys.argv) > 3 else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if which == "hf":
        trainer_cls, args_cls, extra = transformers.Trainer, transformers.TrainingArguments, {}
    else:
        import shardtrain

        trainer_cls, args_cls = shardtrain.Trainer, shardtrain.TrainingArguments
        extra = {"fsdp": "full_shard", "fsdp_config": {"state_dict_type": os.environ.get(
            "STATE_DICT_TYPE", "FULL_STATE_DICT")}} if world > 1 else {}
    per_device = SAMPLES // world // (2 if sys.argv[4:] == ["half"] else 1)
    args = args_cls(output_dir=str(out), per_device_train_batch_size=per_device, max_steps=STEPS,
                    save_steps=4, logging_steps=1, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2,
                    lr_scheduler_type="linear", report_to=[], disable_tqdm=True, seed=7, use_cpu=True,
                    save_strategy="steps", **extra)
    trainer = trainer_cls(model=tiny_llama(tie=True), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "final"))
    if trainer.is_world_process_zero():
        logs = [e for e in trainer.state.log_history if "loss" in e]
        (out / "result.json").write_text(json.dumps({
            "steps": [e["step"] for e in logs], "losses": [e["loss"] for e in logs],
            "lrs": [e["learning_rate"] for e in logs], "global_step": trainer.state.global_step}))
    if which == "ours":
        shardtrain.destroy_distributed()


if __name__ == "__main__":
    main()
