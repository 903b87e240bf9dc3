"""`fsdp_config` "layout": "auto" on a GPT-2 with dropout and tied embeddings, on padded samples: the chosen
layout trains like the default one; "auto" is refused once a process group exists.

torchrun --nproc_per_node 2 auto_layout.py OUT_DIR BUDGET
Rank 0 writes OUT_DIR/result.json: the choice (candidates, predictions, pick), the layout the run applied, the
losses of the auto run and of the default layout, and the error of the refused run.
"""

import json
import sys
from pathlib import Path

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
try:
    train("refused", {**BASE, "layout": "auto"})
    refused = None
except FSDPConfigError as err:
    refused = str(err)
if auto.rank == 0:
    config = auto.spec.fsdp
    OUT.joinpath("result.json").write_text(json.dumps({
        "choice": auto.auto_layout.choice.to_dict(),
        "applied": {"replicate_only": config.replicate_only, "reshard_after_forward": config.reshard_after_forward,
                    "activation_checkpointing": config.ac_mode, "loss_chunk_size": auto.args.loss_chunk_size},
        "losses": [h["loss"] for h in auto.state.log_history if "loss" in h],
        "default_losses": [h["loss"] for h in default.state.log_history if "loss" in h],
        "refused": refused}))
