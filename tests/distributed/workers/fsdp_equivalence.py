"""Train a tiny Llama for a few steps per case, with apply_fsdp (any world size) or plainly (reference).

torchrun --nproc_per_node 2 fsdp_equivalence.py OUT_DIR '{"reshard_false": {"reshard_after_forward": false}}'
python fsdp_equivalence.py OUT_DIR '{"plain": null, "plain_tied": null}'   (null config = no FSDP)
A case named *tied* uses tied embeddings, one named *dropout* attention dropout 0.2; a config's "_env" entry is
set in os.environ for that case only. Each rank trains on its contiguous slice of the global batch;
rank 0 writes OUT_DIR/CASE.json (losses, shard sizes) and OUT_DIR/CASE.pt (full weights).
"""

import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from tiny_models import tiny_llama, token_batches
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardtrain import FSDPConfig, apply_fsdp, destroy_distributed, init_distributed

STEPS, GLOBAL_BATCH = 4, 8


def run_case(out: Path, name: str, config: dict | None) -> None:
    with mock.patch.dict(os.environ, (config or {}).pop("_env", {})):  # restored after the case
        _run_case(out, name, config)


def _reduce_scatters(model: torch.nn.Module) -> list[str]:
    """The reduce-scatter implementations FSDP2 uses in `model`'s units."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return sorted({type(g._reduce_scatter_comm).__name__ for g in groups if g is not None})


def _prefetches(model: torch.nn.Module) -> list[int]:
    """Per FSDP unit (module order): how many units it prefetches in forward and in backward, explicitly."""
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    return [[len(s._states_to_forward_prefetch), len(s._states_to_backward_prefetch)] for s in states]


def _run_case(out: Path, name: str, config: dict | None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tie = "tied" in name
    model = tiny_llama(tie=tie, attention_dropout=0.2 if "dropout" in name else 0.0)
    if config is not None:
        apply_fsdp(model, FSDPConfig.load(config))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    per_rank = GLOBAL_BATCH // world
    losses = []
    gathered_after_forward = None
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        local = batch[rank * per_rank:(rank + 1) * per_rank]
        loss = model(input_ids=local, labels=local).loss
        if gathered_after_forward is None:  # which parameters are whole (not DTensor shards) between fwd and bwd
            gathered_after_forward = {"embedding (root)": not isinstance(model.model.embed_tokens.weight, DTensor),
                                      "layer 0": not isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)}
        loss.backward()
        optim.step()
        optim.zero_grad()
        global_loss = loss.detach().float().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    local_numel = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    numels = [None] * world
    dist.all_gather_object(numels, local_numel)
    prompt = token_batches(1, 2, seq=5, seed=7)[0]
    tokens = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    if rank == 0:
        torch.save({k: v.float() for k, v in state.items()}, out / f"{name}.pt")
        result = {"losses": losses, "local_numels": numels, "full_numel": sum(p.numel() for p in model.parameters()),
                  "tied": model.lm_head.weight is model.model.embed_tokens.weight, "generated": tokens.tolist(),
                  "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
                  "gathered_after_forward": gathered_after_forward,
                  "reduce_scatter": _reduce_scatters(model) if config is not None else [],
                  "prefetches": _prefetches(model) if config is not None else []}
        (out / f"{name}.json").write_text(json.dumps(result))


def main() -> None:
    out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    init_distributed()
    for name, config in cases.items():
        run_case(out, name, config)
    destroy_distributed()


if __name__ == "__main__":
    main()
