"""Launched by tests/cli: check the launcher's environment contract, all_reduce for real, write a report.

    shardtrain launch [flags] tests/cli/scripts/report.py OUT_DIR '{"SHARDTRAIN_USE_FSDP": "1", ...}'

The JSON argument names the environment each rank must see (null: must be unset); a mismatch fails the
rank. Each rank touches OUT_DIR/started-RANK first (so tests can prove a script did not run) and writes
OUT_DIR/rank{RANK}.json: the SHARDTRAIN_* variables, the world, the all_reduce result, and what
`TrainingArguments` resolved from the environment (when shardtrain.train.arguments exists).
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain import FSDPConfig, destroy_distributed, init_distributed

CONTRACT = (
    "SHARDTRAIN_USE_FSDP",
    "SHARDTRAIN_FSDP_CONFIG",
    "SHARDTRAIN_MIXED_PRECISION",
    "SHARDTRAIN_PARALLELISM",
    "SHARDTRAIN_CPU",
    "OMP_NUM_THREADS",
)


def training_arguments() -> dict | None:
    """What TrainingArguments(output_dir=...) resolves from the environment, or None without the module."""
    try:
        from shardtrain.train.arguments import TrainingArguments
    except ModuleNotFoundError as err:
        if err.name in ("shardtrain.train", "shardtrain.train.arguments"):
            return None
        raise
    with tempfile.TemporaryDirectory() as tmp:
        try:
            args = TrainingArguments(output_dir=tmp)
        except ValueError as err:  # e.g. a cp_size this version does not support yet
            return {"error": str(err)}
    return {
        "fsdp_enabled": args.fsdp_enabled,
        "fsdp_config": args.fsdp_config.to_dict(),
        "cp_size": args.cp_size,
        "mixed_precision": args.mixed_precision,
    }


def main() -> None:
    out, expected = Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    out.mkdir(parents=True, exist_ok=True)
    rank_env = os.environ["RANK"]
    (out / f"started-{rank_env}").touch()
    env = {name: os.environ.get(name) for name in CONTRACT}
    for name, value in expected.items():
        assert env.get(name) == value, f"{name}: expected {value!r}, got {env.get(name)!r}"
    if env["SHARDTRAIN_USE_FSDP"] == "1":
        FSDPConfig.load(json.loads(env["SHARDTRAIN_FSDP_CONFIG"]))  # the JSON is a valid fsdp_config
    assert env["SHARDTRAIN_MIXED_PRECISION"] in ("no", "bf16", "fp16"), env

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == int(os.environ["WORLD_SIZE"]) and rank == int(rank_env)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2, total
    report = {
        "env": env,
        "rank": rank,
        "world_size": world,
        "all_reduce": total.item(),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "argv": sys.argv[1:],
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "training_arguments": training_arguments(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    destroy_distributed()


if __name__ == "__main__":
    main()
