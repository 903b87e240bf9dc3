"""A transformers Trainer script with only its import switched, no FSDP setting anywhere, run as a user runs it:
`python plain_script.py OUT` (one process) or `torchrun --nproc_per_node 2 plain_script.py OUT`. Writes OUT/result.json:
the logged losses, whether a process group is up after train() and after evaluate(), and the layout the run used.
The global batch is 4 either way (4 on one process, 2 per rank on two)."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import transformers
from tiny_models import tiny_gpt2, variable_length_dataset

from shardtrain import Trainer, TrainingArguments

out = Path(sys.argv[1])
world = int(os.environ.get("WORLD_SIZE", "1"))
# HF_ARGS=1: transformers' own TrainingArguments handed over (a half-done switch): taken over with one warning
args_cls = transformers.TrainingArguments if os.environ.get("HF_ARGS") else TrainingArguments
args = args_cls(output_dir=str(out), max_steps=4, per_device_train_batch_size=4 // world,
                         per_device_eval_batch_size=2, logging_steps=1, save_steps=2, report_to="none",
                         disable_tqdm=True, seed=0)
data = variable_length_dataset(n=24)
# tied embeddings, padded batches; no dropout: rank slices draw other masks than one process (docs)
trainer = Trainer(tiny_gpt2(dropout=0.0), args, train_dataset=data[:16], eval_dataset=data[16:])
trainer.train()
group_after_train = dist.is_initialized()
eval_loss = trainer.evaluate()["eval_loss"]
if int(os.environ.get("RANK", "0")) == 0:
    (out / "result.json").write_text(json.dumps({
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "eval_loss": eval_loss,
        "group_after_train": group_after_train, "group_after_evaluate": dist.is_initialized(),
        "fsdp_enabled": trainer.args.fsdp_enabled, "sharding": trainer.args.fsdp_config.sharding_strategy}))
