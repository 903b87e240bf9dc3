"""Schedulers that step on the evaluation metric (ReduceLROnPlateau, transformers' GreedyLR), by transformers'
Trainer ("hf", one process) or shardtrain's ("ours", one process or FSDP ranks): a tiny Llama, one full batch,
8 steps, an evaluation every 2; ReduceLROnPlateau in "max" mode on a falling loss, so it cuts the rate at each
evaluation after the first.

    python metric_schedulers.py hf|ours OUT.json
    torchrun --nproc_per_node 2 metric_schedulers.py ours OUT.json
"""

import json
import os
import sys

import transformers
from tiny_models import tiny_llama

WHICH, OUT = sys.argv[1], sys.argv[2]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def main() -> None:
    if WHICH == "hf":
        trainer_cls, args_cls, extra = transformers.Trainer, transformers.TrainingArguments, {}
    else:
        import shardtrain

        trainer_cls, args_cls = shardtrain.Trainer, shardtrain.TrainingArguments
        extra = {"fsdp": "full_shard"} if WORLD > 1 else {}
    rows = [{"input_ids": [i + 1, 2, 3, 4, 5, 6], "labels": [i + 1, 2, 3, 4, 5, 6]} for i in range(8)]
    out = {}
    for kind, kwargs in (("reduce_lr_on_plateau", {"patience": 0, "mode": "max"}), ("greedy", {})):
        args = args_cls(f"{OUT}.{kind}", per_device_train_batch_size=8 // WORLD, per_device_eval_batch_size=4,
                        max_steps=8, eval_strategy="steps", eval_steps=2, logging_steps=1, lr_scheduler_type=kind,
                        lr_scheduler_kwargs=kwargs, learning_rate=1e-2, report_to=[], use_cpu=True,
                        save_strategy="no", disable_tqdm=True, **extra)
        trainer = trainer_cls(model=tiny_llama(), args=args, train_dataset=rows, eval_dataset=rows)
        trainer.train()
        logs = trainer.state.log_history
        out[kind] = {"lrs": [e["learning_rate"] for e in logs if "loss" in e],
                     "losses": [e["loss"] for e in logs if "loss" in e],
                     "eval_losses": [e["eval_loss"] for e in logs if "eval_loss" in e]}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(OUT, "w") as f:
            json.dump(out, f)
    if WHICH == "ours":
        shardtrain.destroy_distributed()


if __name__ == "__main__":
    main()
