"""`shardtrain plan` at 64 and 512 ranks for Llama-3-70B and Qwen3-235B-A22B shapes: tables, wall time, host RSS.

    .venv/bin/python benchmarks/plan_scale.py --out benchmarks/results/plan_scale.json          # ~6 min per case here
    .venv/bin/python benchmarks/plan_scale.py --cases "llama3_70b N64" --out /tmp/s.json

The configs are written by hand from the published shapes (`benchmarks/configs/*.json`; nothing is
downloaded). Each case runs in its own process (`--worker`): the planner traces one rank of the fake process
group of that world size (`torch.distributed` "fake" backend + `FakeStore`, as torchtitan's fake-backend mode)
through the Trainer's own `ParallelDims` -> meshes -> `apply_layout`, and prints its table. Recorded per
case: the table, the JSON plan, the wall time and the planner process's peak resident set (`ru_maxrss`): how
the set-up's host memory grows with the world size (it holds O(world) rank tables of the meshes, nothing else
per rank). Settings: batch 1 x seq 8192 (Llama) / 4096 (Qwen), bf16, full activation checkpointing,
`cpu_ram_efficient_loading`, rates given (400 TFLOP/s, 50 GB/s), 80 GiB devices, one trace (`what_if=False`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {
    "llama3_70b N64": ("llama3_70b.json", 64, {"seq_len": 8192}),
    "llama3_70b N512": ("llama3_70b.json", 512, {"seq_len": 8192}),
    "qwen3_235b_a22b N64 ep8": ("qwen3_235b_a22b.json", 64, {"seq_len": 4096, "ep": 8}),
    "qwen3_235b_a22b N512 ep8": ("qwen3_235b_a22b.json", 512, {"seq_len": 4096, "ep": 8}),
}


def run_case(name: str) -> dict:
    """One plan in this process: its table, JSON, wall time and the process's peak RSS."""
    from shardtrain.plan import plan

    config, world, extra = CASES[name]
    start = time.perf_counter()
    result = plan(HERE / "configs" / config, world_size=world, per_device_batch=1, bf16=True,
                  fsdp_config={"activation_checkpointing": True, "cpu_ram_efficient_loading": True},
                  device_memory="80GiB", tflops=400, link_gbps=50, what_if=False, **extra)
    seconds = time.perf_counter() - start
    return {"case": name, "config": f"benchmarks/configs/{config}", "world_size": world, "seconds": round(seconds, 1),
            "planner_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "table": result.table(), "plan": result.to_dict()}


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def run_setup(name: str) -> dict:
    """The Trainer's set-up alone on the fake process group: `ParallelDims` -> meshes -> `apply_layout` of
    the full-depth model (fake tensors, no step). Host RSS growth of the set-up, time, and whether any parameter
    stayed whole on this rank (a full copy) or any rank holds more than 1 / world of the model."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardtrain.config.fsdp_config import FSDPConfig
    from shardtrain.parallel.dims import ParallelDims
    from shardtrain.plan.experts import GroupedMmShapes
    from shardtrain.plan.model_source import model_builder, to_fake
    from shardtrain.plan.trace import StepSetup, _prepare
    from shardtrain.plan.trace_modes import real_device_meshes

    config, world, extra = CASES[name]
    fsdp = FSDPConfig.load({"activation_checkpointing": True, "cpu_ram_efficient_loading": True})
    build, _ = model_builder(HERE / "configs" / config)
    meta = build()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of what follows
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        dims = ParallelDims.resolve(world_size=world, ep=extra.get("ep", 1), fsdp_config=fsdp)
        meshes = dims.build("cpu")
        setup = StepSetup(dims=dims, fsdp_config=fsdp, per_device_batch=1, seq_len=extra["seq_len"],
                          mixed_precision="bf16")
        with FakeTensorMode() as mode, GroupedMmShapes(), real_device_meshes():
            model, _ = _prepare(to_fake(meta, mode), setup, meshes)
        params = list(model.parameters())
        whole = [p for p in params if not isinstance(p, DTensor)]
        full = sum(p.numel() * p.element_size() for p in params)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
    finally:
        dist.destroy_process_group()
    return {"case": name, "world_size": world, "setup_seconds": round(time.perf_counter() - start, 1),
            "setup_rss_growth_mib": round(_status_mib("VmHWM") - before, 1), "parameters": len(params),
            "unsharded_parameters": len(whole), "model_bytes": full, "rank0_local_bytes": local,
            "rank0_share_x_world": round(local * world / full, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--setup-only", action="store_true",
                        help="only the set-up (meshes + apply_layout), no traced step: seconds per case")
    parser.add_argument("--out", type=Path)
    cli = parser.parse_args()
    if cli.worker:
        print(json.dumps(run_setup(cli.worker) if cli.setup_only else run_case(cli.worker)))
        return
    rows = []
    for name in [c.strip() for c in cli.cases.split(",") if c.strip()]:
        proc = subprocess.run([sys.executable, __file__, "--worker", name, *(["--setup-only"] * cli.setup_only)],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]) if cli.setup_only else
              f"{rows[-1]['table']}\n({rows[-1]['seconds']} s, planner RSS {rows[-1]['planner_max_rss_mib']} MiB)\n")
    if cli.out:
        key = "setup" if cli.setup_only else "cases"
        cli.out.write_text(json.dumps({"benchmark": "plan_scale", key: rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
