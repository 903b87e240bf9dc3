"""Sharded reading of a per-expert mixture-of-experts checkpoint (`cpu_ram_efficient_loading`) against
`from_pretrained`, and training from it under expert parallelism.

torchrun --nproc_per_node 2 load_moe.py OUT.json DIR

Rank 0 writes a tiny Qwen3-MoE (8 experts, 2 layers) with `save_pretrained` into DIR/model (several safetensors
files; transformers 5 writes each expert's gate/up/down projections under its own key, the model fuses them into
3-D `gate_up_proj` / `down_proj`). Every rank loads it with `load_pretrained`:
  * "ep1": FSDP over both ranks (each rank 4 experts' rows of every fused weight);
  * "ep2": ep 2 (each rank its 4 experts; expert-FSDP 1), through the Trainer's `apply_layout`;
  * "ep2_rank0": ep 2 with `read=RANK0_READ` (rank 0 reads all and broadcasts);
and rank 0 compares the gathered weights and the buffers with `from_pretrained(dtype=float32)` bit for bit. What
each rank read of the experts' checkpoint tensors comes from the loader's log record (`read_stats`). Then two
Trainer runs under ep 2 (4 steps): from the path and from a model loaded by `from_pretrained`; losses and final
weights are written too.
"""

import json
import logging
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from launch import LogLines
from rank0_model import train
from tiny_models import tiny_qwen3_moe
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import Qwen3MoeForCausalLM

from shardtrain import FSDPConfig, destroy_distributed, init_distributed, load_pretrained
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.layout import Layout, apply_layout
from shardtrain.parallel.loading import RANK0_READ


def gathered(model: torch.nn.Module) -> tuple[dict, dict]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full, {name: b.clone() for name, b in model.named_buffers()}


def compare(model: torch.nn.Module, ref: Qwen3MoeForCausalLM | None) -> dict:
    full, buffers = gathered(model)
    if ref is None:
        return {}
    ref_state = ref.state_dict()
    return {"keys": len(ref_state), "missing": [k for k in ref_state if k not in full],
            "mismatched": [k for k in ref_state if k in full and not torch.equal(full[k], ref_state[k])],
            "bad_buffers": [k for k, b in ref.named_buffers() if not torch.equal(buffers[k], b)],
            "buffers": len(buffers)}


def load(path: Path, config: FSDPConfig, ep: int, records: LogLines, **kwargs) -> tuple[torch.nn.Module, dict]:
    records.messages.clear()
    records.stats.clear()
    parallelize = None
    if ep > 1:
        dims = ParallelDims.resolve(world_size=dist.get_world_size(), ep=ep, fsdp_config=config)
        meshes = dims.build("cpu")
        parallelize = partial(apply_layout, layout=Layout(meshes=meshes, dims=dims, fsdp=config))
    model = load_pretrained(path, config, parallelize=parallelize, **kwargs)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, records.stats[0] if records.stats else None)
    return model, {"log": list(records.messages), "read": every}


def main() -> None:
    out, root = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed()
    rank = dist.get_rank()
    path = root / "model"
    if rank == 0:
        tiny_qwen3_moe(seed=2).save_pretrained(path, max_shard_size="20KB")
    dist.barrier()
    records = LogLines()
    logger = logging.getLogger("shardtrain.parallel.loading")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    ref = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32) if rank == 0 else None
    config = FSDPConfig.load({"cpu_ram_efficient_loading": True})
    results: dict = {"files": len(list(path.glob("*.safetensors")))}
    if rank == 0:  # what a full read of the experts' checkpoint tensors costs (the files are float32)
        experts = [t for k, t in ref.state_dict().items() if ".mlp.experts." in k]
        results["expert_bytes"] = sum(t.numel() * t.element_size() for t in experts)
    for name, ep, kwargs in (("ep1", 1, {}), ("ep2", 2, {}), ("ep2_rank0", 2, {"read": RANK0_READ})):
        model, facts = load(path, config, ep, records, **kwargs)
        results[name] = {**compare(model, ref), **facts}
        del model
    logger.removeHandler(records)
    runs = {"path": train(str(path), root / "path", ep_size=2)[:2],
            "object": train(Qwen3MoeForCausalLM.from_pretrained(str(path)), root / "object", ep_size=2)[:2]}
    if rank == 0:
        (path_losses, path_weights), (object_losses, object_weights) = runs["path"], runs["object"]
        results["train"] = {"path": path_losses, "object": object_losses,
                            "same_keys": sorted(path_weights) == sorted(object_weights),
                            "max_weight_diff": max((path_weights[k] - object_weights[k]).abs().max().item()
                                                   for k in object_weights)}
        out.write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
