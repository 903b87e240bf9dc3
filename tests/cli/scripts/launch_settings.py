"""Started by `accelerate launch` or `shardtrain launch` with FSDP flags: a Trainer whose arguments set none of
them trains two steps, and rank 0 writes what the run really did to OUT/settings.json.

    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 --mixed_precision bf16 \
        --fsdp_offload_params true --fsdp_activation_checkpointing true launch_settings.py OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
from tiny_models import tiny_llama, variable_length_dataset
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from shardtrain import Trainer, TrainingArguments


def main() -> None:
    out = Path(sys.argv[1])
    os.environ.setdefault("SHARDTRAIN_CPU", "1")
    args = TrainingArguments(str(out / "run"), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                             report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(tiny_llama(), args, train_dataset=variable_length_dataset(16))
    result = trainer.train()
    model = trainer.model
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    report = {
        "world_size": trainer.world_size,
        "fsdp_enabled": args.fsdp_enabled,
        "bf16": args.bf16,
        "cpu_offload": args.fsdp_config.cpu_offload,
        "activation_checkpointing": args.fsdp_config.activation_checkpointing,
        "param_dtypes": sorted({str(s._mp_policy.param_dtype) for s in states}),
        "offloaded": all(isinstance(s._fsdp_param_groups[0].offload_policy, CPUOffloadPolicy)
                         for s in states if s._fsdp_param_groups),
        "checkpointed_layers": sum("CheckpointWrapper" in type(m).__name__ for m in model.modules()),
        "loss": result.training_loss,
        "finite": bool(torch.isfinite(torch.tensor(result.training_loss))),
    }
    if trainer.rank == 0:
        (out / "settings.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
