"""Profile rank 0 of the benchmark runs and summarise where a step's time goes.

    python benchmarks/profile_runs.py --size tiny --out-dir /tmp/bench_prof
    python benchmarks/profile_runs.py --size 50m --steps 4 --warmup 1 --parts split --out-dir /tmp/bench_prof_50m

Launches of `benchmarks/worker.py` on 2 gloo ranks (OMP_NUM_THREADS=1), by part (`--parts`, default all three):
  split:    raw, shardtrain and transformers' Trainer with torch.profiler: each one's step split into compute (aten
            kernels), collectives (c10d / gloo ops, FSDP's all-gather and reduce-scatter ranges, waits: waiting
            included) and host (the rest of the step's wall time: Python, the dispatcher, hooks, data), in ms per
            step and as shares; plus the raw loop's top ops;
  cprofile: raw and shardtrain with cProfile (CPU time): the per-step cost of each stage of the step (forward,
            backward, clipping, optimizer, data, logging), side by side, plus every shardtrain function's own cost,
            so the Trainer's overhead over the raw loop can be read off;
  stages:   raw and shardtrain with `--profile stages`: wall, user and system CPU ms and minor page faults of each
            stage, without a profiler's overhead (system time and page faults come from the allocator).
Prints one JSON object; the raw profiler outputs are kept in --out-dir.
"""

from __future__ import annotations

import argparse
import json
import pstats
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import launch, log  # noqa: E402

COLLECTIVE_WORDS = ("gloo", "c10d", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "barrier",
                    "broadcast", "wait")

# (label, file suffix, function name, line or None) looked up in both cProfile outputs: cumulative CPU ms per
# step (a recursive function counts its outermost calls only).
STAGES = [
    ("model call incl. FSDP hooks (nn.Module.__call__; raw: with loss)", "torch/nn/modules/module.py",
     "_wrapped_call_impl", None),
    ("loss (shardtrain LossComputer.forward)", "shardtrain/train/step/loss.py", "forward", None),
    ("local token counts (LossComputer.local_counts)", "shardtrain/train/step/loss.py", "local_counts", None),
    ("backward (Tensor.backward)", "torch/_tensor.py", "backward", None),
    ("grad norm (get_total_norm)", "torch/nn/utils/clip_grad.py", "_get_total_norm", None),
    ("clip (clip_grads_with_norm_)", "torch/nn/utils/clip_grad.py", "_clip_grads_with_norm_", None),
    ("shardtrain clip_grads (one all_reduce)", "shardtrain/train/step/optim.py", "clip_grads", None),
    ("AdamW step (adam.py step)", "torch/optim/adam.py", "step", None),
    ("lr scheduler step", "torch/optim/lr_scheduler.py", "step", None),
    ("zero_grad", "torch/optim/optimizer.py", "zero_grad", None),
    ("DataLoader __next__", "torch/utils/data/dataloader.py", "__next__", None),
    ("collate (PaddingCollator)", "shardtrain/train/data/batch_plan.py", "__call__", None),
    ("stack (raw batch)", "bench_common.py", "stack", None),
    ("Trainer._maybe_log_evaluate_save", "shardtrain/train/trainer.py", "_maybe_log_evaluate_save", None),
    ("Trainer._callback", "shardtrain/train/trainer.py", "_callback", None),
    ("MetricsLogger.step_done", "shardtrain/train/metrics/logger.py", "step_done", None),
    ("Trainer.training_step", "shardtrain/train/trainer.py", "training_step", None),
    ("FSDP all_gather_single", "distributed_c10d.py", "all_gather_single", None),
    ("FSDP reduce_scatter_single", "distributed_c10d.py", "reduce_scatter_single", None),
    ("all_reduce", "distributed_c10d.py", "all_reduce", None),
    ("c10d wait", "~", "<built-in method torch._C._distributed_c10d.wait>", None),
]


def torch_profile_summary(path: Path, top: int = 15) -> dict[str, Any]:
    data = json.loads(path.read_text())
    steps, ops = data["steps"], data["ops"]
    ops = [o for o in ops if not o["name"].startswith("ProfilerStep")]
    total_self = sum(o["self_cpu_us"] for o in ops)
    ranked = sorted(ops, key=lambda o: o["self_cpu_us"], reverse=True)

    def row(o: dict[str, Any]) -> dict[str, Any]:
        return {"op": o["name"], "calls_per_step": round(o["count"] / steps, 1),
                "self_cpu_ms_per_step": round(o["self_cpu_us"] / 1e3 / steps, 3),
                "cpu_ms_per_step_incl_children": round(o["cpu_us"] / 1e3 / steps, 3),
                "share_of_self_cpu": round(o["self_cpu_us"] / max(total_self, 1), 4)}

    collectives = [o for o in ranked if any(w in o["name"].lower() for w in COLLECTIVE_WORDS)]
    return {"steps": steps, "self_cpu_ms_per_step_total": round(total_self / 1e3 / steps, 2),
            "top_ops_by_self_cpu": [row(o) for o in ranked[:top]],
            "collectives": [row(o) for o in collectives[:12]]}


def _is_collective(name: str) -> bool:
    return any(word in name.lower() for word in COLLECTIVE_WORDS)


def step_split(path: Path, step_ms: float) -> dict[str, Any]:
    """A step's wall time (rank 0, under the profiler) in three parts, from the ops' self CPU time: compute (aten
    kernels that are not collectives), collectives (waiting included) and host (what is left: Python, the
    dispatcher, module hooks, data). Self times of different threads could add up past the wall time; host is
    then 0."""
    data = json.loads(path.read_text())
    steps = data["steps"]
    ops = [o for o in data["ops"] if not o["name"].startswith("ProfilerStep")]
    comm = sum(o["self_cpu_us"] for o in ops if _is_collective(o["name"])) / 1e3 / steps
    compute = sum(o["self_cpu_us"] for o in ops
                  if o["name"].startswith("aten::") and not _is_collective(o["name"])) / 1e3 / steps
    host = max(step_ms - compute - comm, 0.0)
    return {"step_ms": round(step_ms, 2), "compute_ms": round(compute, 2), "collectives_ms": round(comm, 2),
            "host_ms": round(host, 2),
            "shares": {k: round(v / step_ms, 3) if step_ms else None
                       for k, v in (("compute", compute), ("collectives", comm), ("host", host))}}


def _match(stats: pstats.Stats, suffix: str, name: str, line: int | None) -> float:
    """Cumulative seconds of the functions matching (file suffix, name[, line]); recursion counted once."""
    total = 0.0
    for (filename, lineno, funcname), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if funcname == name and filename.endswith(suffix) and (line is None or lineno == line):
            total += ct
    return total


def cprofile_summary(path: Path, steps: int) -> dict[str, Any]:
    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    stages = {label: round(_match(stats, suffix, name, line) * 1e3 / steps, 3)
              for label, suffix, name, line in STAGES}
    own = []
    for (filename, lineno, funcname), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "/shardtrain/" in filename:
            own.append({"function": f"{filename.split('/src/')[-1]}:{lineno}({funcname})",
                        "calls_per_step": round(nc / steps, 2), "own_ms_per_step": round(tt * 1e3 / steps, 3),
                        "cumulative_ms_per_step": round(ct * 1e3 / steps, 3)})
    own.sort(key=lambda r: r["cumulative_ms_per_step"], reverse=True)
    return {"cpu_ms_per_step_total": round(total * 1e3 / steps, 2), "stages_cumulative_cpu_ms_per_step": stages,
            "shardtrain_functions": own[:25]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_profile"))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--parts", default="split,cprofile,stages", help="which launches (see above), comma-separated")
    parser.add_argument("--split-modes", default="raw,shardtrain,hf",
                        help="the worker modes the step split profiles (e.g. shardtrain,shardtrain_auto,hf)")
    cli = parser.parse_args()
    cli.out_dir.mkdir(parents=True, exist_ok=True)
    common = ["--size", cli.size, "--steps", str(cli.steps), "--warmup", str(cli.warmup)]
    summary: dict[str, Any] = {"size": cli.size, "timed_steps": cli.steps, "out_dir": str(cli.out_dir)}

    parts = set(cli.parts.split(","))
    splits: dict[str, Any] = {}
    for mode in cli.split_modes.split(",") if "split" in parts else ():
        log(f"{mode} + torch.profiler ({cli.size})")
        out = cli.out_dir / f"{mode}_{cli.size}_torch.json"
        run = launch(["--mode", mode, *common, "--profile", "torch"], 2, out, cli.timeout)
        if "timing" not in run:
            splits[mode] = {"error": run.get("error"), "stderr_tail": run.get("stderr_tail")}
            continue
        step_ms = run["timing"]["step_time_s_median"] * 1e3
        if mode == "raw":
            summary["raw_torch_profiler"] = torch_profile_summary(Path(f"{out}.profile.json"))
            summary["raw_torch_profiler_step_ms"] = round(step_ms, 2)
        splits[mode] = step_split(Path(f"{out}.profile.json"), step_ms)
    if splits:
        summary["step_split"] = splits

    for mode in ("raw", "shardtrain") if "cprofile" in parts else ():
        log(f"{mode} + cProfile ({cli.size})")
        out = cli.out_dir / f"{mode}_{cli.size}_cprofile.json"
        run = launch(["--mode", mode, *common, "--profile", "cprofile"], 2, out, cli.timeout)
        if "timing" not in run:
            summary[f"{mode}_cprofile"] = {"error": run.get("error"), "stderr_tail": run.get("stderr_tail")}
            continue
        summary[f"{mode}_cprofile"] = {
            "wall_step_ms_median_under_profiler": round(run["timing"]["step_time_s_median"] * 1e3, 2),
            **cprofile_summary(Path(f"{out}.pstats"), cli.steps)}
    stages: dict[str, Any] = {}
    for mode in ("raw", "shardtrain") if "stages" in parts else ():
        log(f"{mode} + per-stage rusage ({cli.size})")
        out = cli.out_dir / f"{mode}_{cli.size}_stages.json"
        run = launch(["--mode", mode, *common, "--profile", "stages"], 2, out, cli.timeout)
        if "timing" in run:
            stages[mode] = {"step": {"wall_ms": round(run["timing"]["step_time_s_median"] * 1e3, 1),
                                     **{k: v for k, v in run.get("rusage_per_step_rank0", {}).items()}},
                            **json.loads(Path(f"{out}.stages.json").read_text())["stages"]}
        else:
            stages[mode] = {"error": run.get("error"), "stderr_tail": run.get("stderr_tail")}
    if stages:
        summary["stages_rank0_per_step"] = stages
    if "raw_cprofile" in summary and "shardtrain_cprofile" in summary and \
            "stages_cumulative_cpu_ms_per_step" in summary["shardtrain_cprofile"]:
        raw_stages = summary["raw_cprofile"]["stages_cumulative_cpu_ms_per_step"]
        st_stages = summary["shardtrain_cprofile"]["stages_cumulative_cpu_ms_per_step"]
        summary["shardtrain_minus_raw_cpu_ms_per_step"] = {
            "total": round(summary["shardtrain_cprofile"]["cpu_ms_per_step_total"]
                           - summary["raw_cprofile"]["cpu_ms_per_step_total"], 2),
            **{k: round(st_stages[k] - raw_stages[k], 3) for k in st_stages if st_stages[k] or raw_stages[k]}}
    text = json.dumps(summary, indent=1)
    (cli.out_dir / f"summary_{cli.size}.json").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
