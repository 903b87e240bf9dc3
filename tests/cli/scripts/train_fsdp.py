"""Launched by tests/cli on two "machines": FSDP2 on a tiny Llama, one training step, a report per rank.

    shardtrain launch --num_machines 2 --machine_rank R ... tests/cli/scripts/train_fsdp.py OUT_DIR

Uses the FSDP settings that `shardtrain launch` passed (SHARDTRAIN_FSDP_CONFIG); each rank writes
OUT_DIR/rank{RANK}.json with its node, world size, shard size and the globally averaged loss.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import tiny_llama, token_batches

from shardtrain import FSDPConfig, apply_fsdp, destroy_distributed, init_distributed


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    assert os.environ["SHARDTRAIN_USE_FSDP"] == "1"
    config = FSDPConfig.load(json.loads(os.environ["SHARDTRAIN_FSDP_CONFIG"]))
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama()
    full_numel = sum(p.numel() for p in model.parameters())
    apply_fsdp(model, config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = token_batches(1, 2 * world)[0][2 * rank : 2 * rank + 2]
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optim.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    report = {
        "rank": rank,
        "world_size": world,
        "node_rank": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "loss": mean_loss.item() / world,
        "local_numel": local_numel,
        "full_numel": full_numel,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    destroy_distributed()


if __name__ == "__main__":
    main()
