"""TRL's trainers on shardtrain's FSDP2 engine (`pip install 'shardtrain[trl]'`).

    from shardtrain.trl import SFTConfig, SFTTrainer
    args = SFTConfig("out", fsdp=True, packing=True, completion_only_loss=True, per_device_train_batch_size=4)
    SFTTrainer(model, args=args, train_dataset=ds, processing_class=tokenizer).train()
    # torchrun --nproc_per_node 8 script.py   (or shardtrain launch script.py)

Each name is TRL's class composed with shardtrain's (`shardtrain.on_engine` / `arguments_on_engine`): TRL's
dataset preparation, collators (packing and padding-free included), losses and metrics; shardtrain's training
loop, FSDP2 sharding (the reference model of DPO included), checkpoints and exact resume. GRPO and RLOO generate
with transformers' `generate` under FSDP2 (no vLLM): their prompts are split per process and their loss is their
own, as under TRL on as many processes (tests/distributed/test_trl_rl.py). Any other TRL trainer:
`shardtrain.on_engine(trl.XTrainer)` with `shardtrain.arguments_on_engine(trl.XConfig)`.
"""

from __future__ import annotations

try:
    import trl as _trl
except ImportError as err:  # an optional extra
    raise ImportError("shardtrain.trl needs TRL, an optional extra: pip install 'shardtrain[trl]'") from err

from shardtrain.train.compose import arguments_on_engine, on_engine

SFTTrainer = on_engine(_trl.SFTTrainer)
SFTConfig = arguments_on_engine(_trl.SFTConfig)
DPOTrainer = on_engine(_trl.DPOTrainer)
DPOConfig = arguments_on_engine(_trl.DPOConfig)
GRPOTrainer = on_engine(_trl.GRPOTrainer)
GRPOConfig = arguments_on_engine(_trl.GRPOConfig)
RLOOTrainer = on_engine(_trl.RLOOTrainer)
RLOOConfig = arguments_on_engine(_trl.RLOOConfig)
KTOTrainer = on_engine(_trl.KTOTrainer)
KTOConfig = arguments_on_engine(_trl.KTOConfig)
RewardTrainer = on_engine(_trl.RewardTrainer)
RewardConfig = arguments_on_engine(_trl.RewardConfig)

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "KTOConfig", "KTOTrainer", "RLOOConfig",
           "RLOOTrainer", "RewardConfig", "RewardTrainer", "SFTConfig", "SFTTrainer"]
