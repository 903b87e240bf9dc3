"""`shardtrain plan`'s predicted step time against measured Trainer steps on this machine, side by side.

    .venv/bin/python benchmarks/plan_step_time.py --out benchmarks/results/plan_step_time.json        # ~5 min
    .venv/bin/python benchmarks/plan_step_time.py --sizes tiny --steps 5 --out /tmp/st.json  # a quick look

For each model size (`bench_common.SIZES`): the planner's step time (traced FLOPs / a matmul rate measured here,
plus ring-collective bytes / a memory-copy rate measured here; with and without overlap), beside the median step
of real runs of `benchmarks/worker.py` in the same invocation: one process without FSDP (what the compute term
predicts), and the Trainer on 1 and 2 ranks, full_shard and no_shard (gloo, OMP_NUM_THREADS=1 per rank).
`error` is predicted (no overlap) / measured - 1; `error_gloo_link` the same with the link rate of a gloo
all-gather between 2 local processes measured here (what `--link-gbps` would be given). Prints one JSON object
and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import LAYER_CLASS, SIZES, llama_config  # noqa: E402
from compare import launch, log, machine_info  # noqa: E402

# name, ranks, worker mode, fsdp_config for the planner (as the worker's variant sets it)
CONFIGS = [
    ("N1 full_shard", 1, "shardtrain", {}),
    ("N2 full_shard", 2, "shardtrain", {}),
    ("N2 no_shard", 2, "shardtrain_no_shard", {"sharding_strategy": "NO_SHARD"}),
]


GLOO_PROBE = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
world, nbytes = dist.get_world_size(), 32 * 2**20
shard = torch.empty(nbytes // 4 // world)
out = torch.empty(nbytes // 4)
dist.all_gather_into_tensor(out, shard)
start = time.perf_counter()
for _ in range(5):
    dist.all_gather_into_tensor(out, shard)
rate = 5 * nbytes * (world - 1) / world / (time.perf_counter() - start)
if dist.get_rank() == 0:
    print("RATE", rate)
dist.destroy_process_group()
"""


def gloo_link_rate(nproc: int = 2) -> float:
    """Bytes/s one rank sends in a gloo all-gather of 32 MiB between `nproc` local processes (1 thread each)."""
    from compare import free_port, worker_env

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(GLOO_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f.name]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    os.unlink(f.name)
    return float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RATE")))


def predict(size: str, nproc: int, fsdp: dict) -> dict:
    from shardtrain.plan import plan

    spec = SIZES[size]
    config = llama_config(spec)
    result = plan(config, fsdp_config={"transformer_layer_cls_to_wrap": [LAYER_CLASS], **fsdp}, world_size=nproc,
                  per_device_batch=spec.per_device_batch, seq_len=spec.seq_len, target="cpu", what_if=False)
    return {k: v for k, v in result.step.items() if k != "collective_bytes"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,50m")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run, after 2 warm-up steps")
    parser.add_argument("--out", type=Path, required=True)
    cli = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # as every measured run has it: the planner calibrates on 1 thread
    started = time.perf_counter()
    gloo_rate = gloo_link_rate()
    log(f"gloo all-gather between 2 local processes: {gloo_rate / 1e9:.2f} GB/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in cli.sizes.split(","):
            log(f"{size}: one process without FSDP")
            single = launch(["--mode", "single", "--sizes", size, "--steps", str(cli.steps), "--warmup", "2"], None,
                            Path(tmp) / f"single-{size}.json", timeout=1200)
            bound = single[size]["timing"]["step_time_s_median"] if size in single else None
            for name, nproc, mode, fsdp in CONFIGS:
                log(f"{size}: {name} ({mode})")
                run = launch(["--mode", mode, "--size", size, "--steps", str(cli.steps), "--warmup", "2"], nproc,
                             Path(tmp) / f"{size}-{mode}-{nproc}.json", timeout=1200)
                measured = run["timing"]["step_time_s_median"] if "timing" in run else None
                predicted = predict(size, nproc, fsdp)
                rows.append({
                    "size": size, "config": name, "measured_step_s": measured, "measured_no_fsdp_step_s": bound,
                    "predicted_compute_s": round(predicted["compute_s"], 5),
                    "predicted_comm_s": round(predicted["comm_s"], 5),
                    "predicted_step_s_no_overlap": round(predicted["step_s_no_overlap"], 5),
                    "predicted_step_s_full_overlap": round(predicted["step_s_full_overlap"], 5),
                    "error": round(predicted["step_s_no_overlap"] / measured - 1, 3) if measured else None,
                    # the same prediction with the link rate of gloo measured here instead of the copy stand-in
                    "predicted_step_s_gloo_link": round(predicted["compute_s"] + predicted["wire_bytes"] / gloo_rate,
                                                        5),
                    "error_gloo_link": round((predicted["compute_s"] + predicted["wire_bytes"] / gloo_rate)
                                             / measured - 1, 3) if measured else None,
                    "compute_error_vs_no_fsdp": round(predicted["compute_s"] / bound - 1, 3) if bound else None,
                    "rates": {k: predicted[k] for k in ("flops_rate", "flops_rate_source", "link_rate",
                                                        "link_rate_source")},
                    **({"run_error": run.get("error"), "stderr_tail": run.get("stderr_tail")} if not measured else {}),
                })
    result = {"benchmark": "plan_step_time", "machine": machine_info(), "steps": cli.steps,
              "gloo_link_bytes_per_s": round(gloo_rate), "rows": rows,
              "wall_s": round(time.perf_counter() - started, 1)}
    cli.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
