"""`fsdp_config` "layout": "auto" on a GPT-2 with dropout and tied embeddings, on padded samples: the chosen
layout trains like the default one; once the process group exists, "auto" traces in a fresh process.

torchrun --nproc_per_node 2 auto_layout.py OUT_DIR BUDGET
Rank 0 writes OUT_DIR/result.json: the choice (candidates, predictions, pick), the layout the run applied, the
losses of the auto run and of the default layout, and the choice and losses of the run after the process group had
started (traced in a fresh process); OUT/refused_<rank>.txt: each rank's error for a model the fresh process cannot
rebuild.
"""

import json
import sys
from pathlib import Path

import torch
from tiny_models import tiny_gpt2, variable_length_dataset

from shardtrain import Trainer, TrainingArguments
from shardtrain.errors import FSDPConfigError

OUT, BUDGET = Path(sys.argv[1]), sys.argv[2]
BASE = {"transformer_layer_cls_to_wrap": ["GPT2Block"]}


def train(name: str, fsdp_config: dict) -> Trainer:
    args = TrainingArguments(output_dir=str(OUT / name), per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                             disable_tqdm=True, fsdp=True, fsdp_config=fsdp_config, seed=7)
    trainer = Trainer(tiny_gpt2(seed=0), args, train_dataset=variable_length_dataset(64))
    trainer.train()
    return trainer


auto = train("auto", {**BASE, "layout": "auto", "max_memory_per_rank": BUDGET})
default = train("default", BASE)
group_was_up = torch.distributed.is_initialized()  # left up by the runs before: "auto" traces in a fresh process
started = train("started", {**BASE, "layout": "auto", "max_memory_per_rank": BUDGET})
try:  # a model a fresh process cannot rebuild: every rank stops with rank 0's error (none waits in a collective)
    Trainer(torch.nn.Sequential(torch.nn.Linear(2, 2)),
            TrainingArguments(output_dir=str(OUT / "plain"), fsdp=True, report_to="none",
                              fsdp_config={"layout": "auto"}), train_dataset=variable_length_dataset(8))
    refused = None
except FSDPConfigError as err:
    refused = str(err)
OUT.joinpath(f"refused_{auto.rank}.txt").write_text(str(refused))
if auto.rank == 0:
    config = auto.spec.fsdp
    OUT.joinpath("result.json").write_text(json.dumps({
        "choice": auto.auto_layout.choice.to_dict(),
        "applied": {"replicate_only": config.replicate_only, "reshard_after_forward": config.reshard_after_forward,
                    "activation_checkpointing": config.ac_mode, "loss_chunk_size": auto.spec.loss_chunk_size},
        "losses": [h["loss"] for h in auto.state.log_history if "loss" in h],
        "default_losses": [h["loss"] for h in default.state.log_history if "loss" in h],
        "group_was_up": group_was_up, "started_choice": started.auto_layout.choice.to_dict(),
        "started_losses": [h["loss"] for h in started.state.log_history if "loss" in h]}))
