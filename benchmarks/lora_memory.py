"""Model-state bytes per rank: LoRA vs full fine-tuning of the 50M benchmark Llama under FSDP2, side by side.

    .venv/bin/python benchmarks/lora_memory.py --out benchmarks/results/lora_memory.json    # ~1 min, 2 ranks
    .venv/bin/python benchmarks/lora_memory.py --size tiny --out /tmp/lora.json

One `python -m torch.distributed.run --nproc_per_node 2` launch of this file (`--worker`, gloo) builds the model
(`bench_common.SIZES`) three ways, shards it with `apply_fsdp` over both ranks and takes one AdamW step on one
batch, keeping the gradients (the moment when parameters, gradients and both AdamW moments all exist):

  * `full`: every parameter trains (fp32).
  * `lora`: peft LoRA r=16 on q/k/v/o projections; the fp32 base is frozen, the optimizer holds the adapters.
  * `lora_bf16_base`: as `lora`, the frozen base stored in bf16 (adapters fp32; FSDP computes in bf16).

Measured from the tensors on each rank: local parameter, gradient and AdamW `exp_avg` / `exp_avg_sq` bytes
(`bench_common`), the largest rank reported; `ratio_vs_full` = that mode's bytes / full's. Prints JSON, writes --out.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = ("full", "lora", "lora_bf16_base")


def worker(cli: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from bench_common import (
        LAYER_CLASS,
        SIZES,
        build_model,
        gather_to_rank0,
        grad_bytes,
        make_samples,
        optimizer_state_bytes,
        param_bytes,
        stack,
    )
    from peft import LoraConfig, get_peft_model

    from shardtrain.config.fsdp_config import FSDPConfig
    from shardtrain.parallel.distributed import destroy_distributed, init_distributed
    from shardtrain.parallel.fsdp import apply_fsdp

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = SIZES[cli.size]
    results: dict[str, Any] = {}
    for mode in MODES:
        model = build_model(spec)
        total_params = sum(p.numel() for p in model.parameters())
        precision = None
        if mode != "full":
            if mode == "lora_bf16_base":
                model.to(torch.bfloat16)
                precision = "bf16"
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj",
                                                                                           "v_proj", "o_proj"]))
            for param in model.parameters():  # adapters train in fp32 whatever the base is stored in
                if param.requires_grad:
                    param.data = param.data.float()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        apply_fsdp(model, FSDPConfig.load({"transformer_layer_cls_to_wrap": [LAYER_CLASS]}),
                   mixed_precision=precision)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        batch = stack(make_samples(spec, world)[rank:rank + 1])
        model(**batch).loss.float().backward()
        optimizer.step()
        state = optimizer_state_bytes(optimizer)
        mine = {"param_bytes": param_bytes(model), "grad_bytes": grad_bytes(model),
                "optimizer_bytes": state.get("exp_avg", 0) + state.get("exp_avg_sq", 0)}
        mine["model_state_bytes"] = sum(mine.values())
        ranks = gather_to_rank0(mine)
        if rank == 0:
            results[mode] = {"total_params": total_params, "trainable_params": trainable,
                             "model_state_bytes_max_rank": max(r["model_state_bytes"] for r in ranks),
                             "per_rank": ranks}
        del model, optimizer
        gc.collect()
    if rank == 0:
        full = results["full"]["model_state_bytes_max_rank"]
        for entry in results.values():
            entry["ratio_vs_full"] = round(entry["model_state_bytes_max_rank"] / full, 4)
        Path(cli.out_file).write_text(json.dumps(results))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="50m")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    from bench_common import emit, launch_self

    modes = launch_self(Path(__file__), 2, ["--size", cli.size], "lora_memory worker")
    result = {"benchmark": "lora_memory", "size": cli.size, "ranks": 2, "modes": modes, "goal": "lora <= 0.3 x full"}
    emit(result, cli.out)


if __name__ == "__main__":
    main()
