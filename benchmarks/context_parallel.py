"""Activation memory and step time of one long sequence: cp=1 vs cp=2 (and cp=2 re-gathering K/V in backward).

    .venv/bin/python benchmarks/context_parallel.py --out benchmarks/results/context_parallel.json   # ~3 min, 2 ranks
    .venv/bin/python benchmarks/context_parallel.py --seq 512 --steps 2 --out /tmp/cp.json   # quick

One `python -m torch.distributed.run --nproc_per_node 2` launch of this file (`--worker`, gloo, OMP_NUM_THREADS=1
per rank) per mode, on the same grouped-query Llama (8 query heads, 2 K/V heads) with FSDP2 over both ranks:

  * `cp1`: each rank trains on its own sequence of `--seq` tokens (data parallel; the reference).
  * `cp2`: the two ranks split one sequence of `--seq` tokens (context parallel, gathered K/V and SDPA's
    intermediates kept for backward: `ContextParallel(recompute=False)`, `cp_regather_kv=False`).
  * `cp2_recompute`: as cp2, K/V gathered again in backward (`recompute=True`, the Trainer's default).

Measured per rank, over the timed steps: the tensor high-water mark of one forward+backward, by
`torch.distributed._tools.mem_tracker.MemTracker` (every tensor created in the step, by category: activations,
temporaries, gradients, parameters; named in the JSON), and the bytes saved for backward at the end of the
forward (`saved_tensors_hooks`, unique storages, parameters excluded); the step time (forward, backward,
optimizer) after warm-up, and tokens per second over both ranks (cp1 trains two sequences per step, cp2 one).
`activation_ratio` = cp2 / cp1 of the activation + temporary high-water mark.
Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = {"cp1": (1, False), "cp2": (2, False), "cp2_recompute": (2, True)}


def build_model(seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=seq,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def saved_bytes(model, step) -> int:
    """Bytes of the unique non-parameter storages saved for backward by `step()`'s forward (FSDP's gathered
    parameters, saved by linear layers, are parameters or views of them: not counted)."""
    import torch
    from torch import nn

    seen: dict[int, int] = {}

    def pack(tensor):
        if not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def worker(cli: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardtrain.config.fsdp_config import FSDPConfig
    from shardtrain.parallel.context import ContextParallel
    from shardtrain.parallel.dims import ParallelDims
    from shardtrain.parallel.distributed import destroy_distributed, init_distributed
    from shardtrain.parallel.fsdp import apply_fsdp

    init_distributed()
    cp_size, recompute = MODES[cli.mode]
    dims = ParallelDims.resolve(world_size=dist.get_world_size(), cp=cp_size)
    meshes = dims.build("cpu")
    model = build_model(cli.seq)
    cp = ContextParallel(meshes.cp, recompute=recompute) if cp_size > 1 else None
    if cp is not None:
        cp.enable(model)
    apply_fsdp(model, FSDPConfig.load({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}), meshes.fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + meshes.batch_rank)  # cp ranks share their sequence
    input_ids = torch.randint(0, 2048, (1, cli.seq), generator=gen)
    batch = {"input_ids": input_ids, "labels": input_ids}

    def forward():
        inputs = cp.shard(batch, shift_labels=True) if cp is not None else \
            {"input_ids": input_ids, "shift_labels": F.pad(input_ids[:, 1:], (0, 1), value=-100)}
        labels = inputs.pop("shift_labels")
        logits = model(**inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def step() -> None:
        forward().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(cli.warmup):
        step()
    times = []
    for _ in range(cli.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    saved = saved_bytes(model, forward)
    optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = {str(k): v for k, v in tracker.get_tracker_snapshot("peak").items()}
    result = {"rank": dist.get_rank(), "mode": cli.mode, "cp": cp_size, "recompute": recompute,
              "seq": cli.seq, "local_tokens": cli.seq // cp_size, "step_s": times,
              "step_s_median": statistics.median(times), "saved_for_backward_mb": saved / 2**20,
              "peak_by_category_mb": {dev: {str(k).split(".")[-1].lower(): v / 2**20 for k, v in cats.items()}
                                     for dev, cats in peak.items()}}
    Path(cli.out_dir, f"{cli.mode}_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    destroy_distributed()


def _activation_mb(category_mb: dict[str, float]) -> float:
    return category_mb.get("act", 0.0) + category_mb.get("temp", 0.0)


def summarize(out_dir: Path, modes: list[str]) -> dict[str, Any]:
    per_mode: dict[str, Any] = {}
    for mode in modes:
        ranks = [json.loads((out_dir / f"{mode}_rank{r}.json").read_text()) for r in range(2)]
        categories = [next(iter(r["peak_by_category_mb"].values())) for r in ranks]
        per_mode[mode] = {
            "cp": ranks[0]["cp"], "recompute": ranks[0]["recompute"], "tokens_per_rank": ranks[0]["local_tokens"],
            "step_s_median": max(r["step_s_median"] for r in ranks),
            # cp1: each rank trains its own sequence; cp2: the two ranks share one
            "sequences_per_step": 2 // ranks[0]["cp"],
            "tokens_per_second": round(ranks[0]["seq"] * (2 // ranks[0]["cp"])
                                       / max(r["step_s_median"] for r in ranks)),
            "activation_and_temp_peak_mb_per_rank": [round(_activation_mb(c), 2) for c in categories],
            "saved_for_backward_mb_per_rank": [round(r["saved_for_backward_mb"], 2) for r in ranks],
            "peak_by_category_mb_rank0": {k: round(v, 2) for k, v in categories[0].items()},
        }
    base = max(per_mode["cp1"]["activation_and_temp_peak_mb_per_rank"]) if "cp1" in per_mode else None
    for entry in per_mode.values():
        if base:
            entry["activation_ratio_vs_cp1"] = round(max(entry["activation_and_temp_peak_mb_per_rank"]) / base, 3)
            entry["saved_ratio_vs_cp1"] = round(max(entry["saved_for_backward_mb_per_rank"]) /
                                                max(per_mode["cp1"]["saved_for_backward_mb_per_rank"]), 3)
            entry["step_time_ratio_vs_cp1"] = round(entry["step_s_median"] / per_mode["cp1"]["step_s_median"], 3)
    return per_mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), default="cp1", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    from bench_common import emit, run_worker

    modes = cli.modes.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDTRAIN_CPU": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(Path(__file__)),
                   "--worker", "--mode", mode, "--out-dir", tmp, "--seq", str(cli.seq), "--steps", str(cli.steps),
                   "--warmup", str(cli.warmup)]
            run_worker(cmd, env, mode, cwd=REPO)
        result = {"benchmark": "context_parallel", "model": "Llama 4 layers, hidden 256, 8 heads / 2 K/V heads, "
                  "vocab 2048", "ranks": 2, "seq": cli.seq, "steps": cli.steps, "modes": summarize(Path(tmp), modes)}
    emit(result, cli.out)


if __name__ == "__main__":
    main()
