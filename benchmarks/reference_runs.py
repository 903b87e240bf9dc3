"""The two reference measurements `worker.py` runs beside the training modes (`--mode single`, `--mode state`):
the one-process compute lower bound, and the model-state bytes per rank after one AdamW step under `apply_fsdp`.
Their command lines are in worker.py's docstring; this module only holds them, so each runner file stays short."""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    FUSED_ADAMW,
    LAYER_CLASS,
    LEARNING_RATE,
    MAX_GRAD_NORM,
    WEIGHT_DECAY,
    SizeSpec,
    StepTimer,
    build_model,
    gather_to_rank0,
    grad_bytes,
    make_samples,
    optimizer_state_bytes,
    param_bytes,
    stack,
    summarize_steps,
)
from torch.distributed.tensor import DTensor


# -- single process, no FSDP: compute lower bound -------------------------------------------------------
def run_single(cli: argparse.Namespace, specs: list[SizeSpec]) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {"mode": "single", "threads": torch.get_num_threads()}
    for spec in specs:
        total = cli.warmup + cli.steps
        samples = make_samples(spec, total * spec.per_device_batch)
        model = build_model(spec)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                                      fused=FUSED_ADAMW)
        timer = StepTimer(use_barrier=False)
        timer.mark()
        for step in range(total):
            batch = stack(samples[step * spec.per_device_batch:(step + 1) * spec.per_device_batch])
            model(**batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timer.mark()
        tokens = spec.per_device_batch * spec.seq_len
        results[spec.name] = {"timing": summarize_steps(timer.durations(), timer.cpu_durations(), cli.warmup, tokens),
                              "rusage_per_step_rank0": timer.usage_per_step(cli.warmup),
                              "num_params": sum(p.numel() for p in model.parameters())}
        del model, optimizer
        gc.collect()
    cli.out.write_text(json.dumps(results, indent=1))


# -- model-state bytes per rank after one AdamW step under shardtrain.apply_fsdp ------------------------
def _state_meshes(world: int, groups: str | None) -> list[tuple[int, Any]]:
    """(N, mesh) pairs: the whole world (mesh None: apply_fsdp's default), or sub-meshes of N ranks each."""
    if not groups:
        return [(world, None)]
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for n in (int(x) for x in groups.split(",")):
        if n == world:
            out.append((n, None))
        else:
            mesh = init_device_mesh("cpu", (world // n, n), mesh_dim_names=("replicate", "shard"))
            out.append((n, mesh["shard"]))
    return out


def run_state(cli: argparse.Namespace, specs: list[SizeSpec]) -> None:
    from shardtrain.config.fsdp_config import FSDPConfig
    from shardtrain.parallel.distributed import init_distributed
    from shardtrain.parallel.fsdp import apply_fsdp

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {"mode": "state", "world_size": world, "by_n": {}}
    for n, mesh in _state_meshes(world, cli.submeshes):
        by_size = results["by_n"].setdefault(str(n), {})
        for spec in specs:
            model = build_model(spec)
            num_params = sum(p.numel() for p in model.parameters())
            apply_fsdp(model, FSDPConfig.load({"transformer_layer_cls_to_wrap": [LAYER_CLASS]}), mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                                          fused=FUSED_ADAMW)
            batch = stack(make_samples(spec, world)[rank:rank + 1])
            model(**batch).loss.backward()
            optimizer.step()  # grads kept: the moment when params, grads and both moments all exist
            state = optimizer_state_bytes(optimizer)
            mine = {"param_bytes": param_bytes(model), "grad_bytes": grad_bytes(model),
                    "exp_avg_bytes": state.get("exp_avg", 0), "exp_avg_sq_bytes": state.get("exp_avg_sq", 0),
                    "step_bytes": state.get("step", 0),
                    "step_tensors": sum(1 for s in optimizer.state.values() if "step" in s),
                    "param_storage_bytes_incl_padding": sum(
                        {id(p.to_local().untyped_storage()): p.to_local().untyped_storage().nbytes()
                         for p in model.parameters() if isinstance(p, DTensor)}.values())}
            mine["model_state_bytes"] = mine["param_bytes"] + mine["grad_bytes"] + mine["exp_avg_bytes"] \
                + mine["exp_avg_sq_bytes"]
            ranks = gather_to_rank0(mine)
            if rank == 0:
                ranks = ranks[:n]  # with sub-meshes, ranks 0..n-1 form the first mesh
                formula = 16 * num_params / n
                worst = max(r["model_state_bytes"] for r in ranks)
                by_size[spec.name] = {
                    "num_params": num_params, "formula_bytes_16P_over_N": formula,
                    "measured_bytes_max_rank": worst, "ratio_measured_over_formula": worst / formula,
                    "ratio_with_step_tensors": max(r["model_state_bytes"] + r["step_bytes"] for r in ranks) / formula,
                    "method": f"apply_fsdp on a world of {n} gloo ranks" if mesh is None else
                              f"apply_fsdp on a {n}-rank sub-mesh of a {world}-rank gloo world",
                    "per_rank": ranks}
            del model, optimizer
            gc.collect()
    if rank == 0:
        results["note"] = ("measured = local params + grads + exp_avg + exp_avg_sq (fp32) of the largest rank, "
                           "after one AdamW step with grads still held; AdamW's 'step' is one unsharded 4-byte "
                           "tensor per parameter tensor, reported apart (step_bytes, ratio_with_step_tensors)")
        cli.out.write_text(json.dumps(results, indent=1))
