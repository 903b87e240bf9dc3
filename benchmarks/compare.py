"""Side-by-side training benchmark: raw `fully_shard` loop vs shardtrain `Trainer` vs Hugging Face `Trainer`.

    python benchmarks/compare.py --out results.json            # full run (~25 min on 2 CPU cores)
    python benchmarks/compare.py --quick --out results.json    # short run (~4 min)
    python benchmarks/compare.py --sizes tiny --repeats 1 --out tiny.json --markdown table.md

Everything is measured in one run on this machine with the same model, data, batch, steps, lr and FSDP
settings: each mode is one `python -m torch.distributed.run --nproc_per_node 2` launch of
`benchmarks/worker.py` (gloo, OMP_NUM_THREADS=1 per rank); the modes are interleaved `--repeats` times and
the step times of all repeats are pooled. Also measured: the one-process step time without FSDP on the
per-rank batch (compute lower bound, 1 thread) and the model-state bytes per rank on 1, 2 and 4 ranks
against 16*P/N. Prints one JSON object and writes it to --out. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "worker.py"
# shardtrain_no_shard: plain data parallel (as transformers' DDP); shardtrain_auto: fsdp_config "layout": "auto"
# with the default budget (this machine's memory / 2: every layout fits)
MODES = ("raw", "shardtrain", "shardtrain_no_shard", "shardtrain_auto", "hf")

# (timed steps, warm-up steps) per size
FULL_STEPS = {"tiny": (40, 5), "50m": (10, 2)}
QUICK_STEPS = {"tiny": (10, 2), "50m": (3, 1)}


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EXTRA_ENV: dict[str, str] = {}  # --env KEY=VALUE, e.g. glibc malloc tunables


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SHARDTRAIN_CPU="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env.update(EXTRA_ENV)
    return env


def cpu_busy_percent(seconds: float = 1.0) -> float:
    """Whole-machine CPU use over `seconds` just before a launch (other users' load skews timings)."""
    return psutil.cpu_percent(interval=seconds)


def launch(worker_args: list[str], nproc: int | None, out: Path, timeout: float) -> dict[str, Any]:
    """Run the worker (under torchrun when `nproc`), return its JSON plus launch facts, or an error record."""
    if nproc is None:
        cmd = [sys.executable, str(WORKER), *worker_args, "--out", str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(WORKER), *worker_args, "--out", str(out)]
    busy = cpu_busy_percent()
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as err:
        returncode, stderr = "timeout", (err.stderr or b"").decode(errors="replace") if isinstance(
            err.stderr, bytes) else (err.stderr or "")
    wall = time.perf_counter() - started
    facts = {"launch_wall_s": round(wall, 1), "cpu_busy_percent_before": busy, "load_avg_after": os.getloadavg()}
    if returncode == 0 and out.exists():
        return {**json.loads(out.read_text()), "launch": facts}
    return {"error": f"worker exited with {returncode}", "stderr_tail": stderr[-3000:], "launch": facts,
            "command": " ".join(cmd)}


def machine_info() -> dict[str, Any]:
    import accelerate
    import torch
    import transformers

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False), "cpu_model": model,
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "load_avg_at_start": os.getloadavg()}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge repeats of one mode: median over the pooled timed steps; memory: max over repeats and ranks."""
    ok = [r for r in runs if "timing" in r]
    summary: dict[str, Any] = {}
    if not ok:
        first = runs[0] if runs else {}
        summary["error"] = first.get("error", "no run")
        for key in ("stderr_tail", "traceback_tail", "what_hf_did", "command"):
            if key in first:
                summary[key] = first[key]
        return summary
    times = [t for r in ok for t in r["timing"]["step_times_s"]]
    cpu = [r["timing"]["cpu_time_per_step_s_median"] for r in ok]
    median = statistics.median(times)
    tokens = ok[0]["timing"]["tokens_per_step"]
    ranks = [rank for r in ok for rank in r.get("per_rank", [])]
    summary.update({
        "steps_per_s": round(1 / median, 4), "tokens_per_s": round(tokens / median, 1),
        "step_time_s_median": round(median, 5), "step_time_s_p10_p90": [round(q, 5) for q in _deciles(times)],
        "cpu_time_per_step_s_median_rank0": round(statistics.median(cpu), 5),
        **_usage(ok),
        "timed_steps_total": len(times), "repeats": len(ok),
        "steps_per_s_per_repeat": [round(r["timing"]["steps_per_s"], 4) for r in ok],
        "tokens_per_step": tokens,
        "peak_rss_delta_mib_per_rank": _per_rank_max(ok, "peak_rss_delta_bytes", 2**20),
        "model_state_bytes_per_rank": _state_bytes(ranks),
        "sharding": ok[0].get("what_hf_did") or ok[0].get("sharding"),
        "mean_loss": ok[0].get("mean_loss", ok[0].get("mean_loss_rank0")),
        "cpu_busy_percent_before_launch": [r["launch"]["cpu_busy_percent_before"] for r in ok],
        "first_step_s": [r.get("first_step_s") for r in ok],  # torch_compile compiles during the first step
    })
    if any(r.get("layout_choice") for r in ok):  # "layout": "auto": what each launch picked
        summary["layout_chosen"] = [(r.get("layout_choice") or {}).get("chosen") for r in ok]
    return summary


def _usage(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Rank 0's user / system CPU and minor page faults per step (median over repeats of the medians)."""
    usages = [r.get("rusage_per_step_rank0") for r in runs if r.get("rusage_per_step_rank0")]
    if not usages:
        return {}
    return {"user_cpu_s_per_step_rank0": round(statistics.median(u["user_s_median"] for u in usages), 5),
            "sys_cpu_s_per_step_rank0": round(statistics.median(u["sys_s_median"] for u in usages), 5),
            "minor_page_faults_per_step_rank0": statistics.median(u["minor_page_faults_median"] for u in usages)}


def _deciles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    cuts = statistics.quantiles(values, n=10)
    return [cuts[0], cuts[-1]]


def _per_rank_max(runs: list[dict[str, Any]], key: str, unit: int) -> list[float]:
    world = len(runs[0].get("per_rank", []))
    return [round(max(r["per_rank"][i][key] for r in runs if len(r.get("per_rank", [])) > i) / unit, 1)
            for i in range(world)]


def _state_bytes(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """params + grads + optimizer state of the largest rank (local tensors; `step` listed apart)."""
    if not ranks:
        return {}
    worst = max(ranks, key=lambda r: r.get("param_bytes", 0))
    opt = worst.get("optimizer_state_bytes", {})
    out = {"params": worst.get("param_bytes", 0), "grads": worst.get("grad_bytes", 0),
           "exp_avg": opt.get("exp_avg", 0), "exp_avg_sq": opt.get("exp_avg_sq", 0), "step": opt.get("step", 0)}
    out["total_without_step"] = out["params"] + out["grads"] + out["exp_avg"] + out["exp_avg_sq"]
    return out


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    if "steps_per_s" in a and "steps_per_s" in b:
        return round(a["steps_per_s"] / b["steps_per_s"], 4)
    return None


def cpu_ratio(a: dict[str, Any], b: dict[str, Any], key: str = "cpu_time_per_step_s_median_rank0") -> float | None:
    if a.get(key) and b.get(key):
        return round(b[key] / a[key], 4)
    return None


def markdown(results: dict[str, Any]) -> str:
    """The measured table for benchmarks/README.md."""
    lines = ["| size | mode | steps/s | tokens/s | step ms (median) | CPU ms/step (rank 0) "
             "| user / sys ms, page faults | peak RSS delta MiB/rank | model state MiB/rank | sharded |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for size, res in results["sizes"].items():
        for mode in [m for m in res if not m.startswith("ratios") and m != "step_over_compute_bound"]:
            row = res[mode]
            if "steps_per_s" not in row:
                lines.append(f"| {size} | {mode} | error: {row.get('error', 'not run')[:80]} | | | | | | | |")
                continue
            state = row.get("model_state_bytes_per_rank", {}).get("total_without_step")
            sharded = (row.get("sharding") or {}).get("sharded", "—" if mode.startswith("single") else "?")
            rss = row.get("peak_rss_delta_mib_per_rank", "—")
            lines.append(f"| {size} | {mode} | {row['steps_per_s']:.3f} | {row['tokens_per_s']:.0f} | "
                         f"{row['step_time_s_median'] * 1e3:.1f} | "
                         f"{row.get('cpu_time_per_step_s_median_rank0', 0) * 1e3:.1f} | "
                         f"{row.get('user_cpu_s_per_step_rank0', 0) * 1e3:.0f} / "
                         f"{row.get('sys_cpu_s_per_step_rank0', 0) * 1e3:.0f}, "
                         f"{row.get('minor_page_faults_per_step_rank0', 0):.0f} | {rss} | "
                         f"{'—' if state is None else f'{state / 2**20:.2f}'} | {sharded} |")
        for key in ("ratios", "ratios_cpu_time", "ratios_user_cpu_time"):
            text = ", ".join(f"{k} = {v}" for k, v in res.get(key, {}).items())
            lines.append(f"| {size} | {key} (steps/s) | {text} | | | | | | | |")
        text = ", ".join(f"{k} = {v}" for k, v in res.get("step_over_compute_bound", {}).items())
        lines.append(f"| {size} | step / compute bound (goal <= 1.5) | {text} | | | | | | | |")
    lines += ["", "| size | N | measured bytes/rank | 16·P/N | measured/formula | + step tensors |",
              "|---|---|---|---|---|---|"]
    for size, per_n in results.get("model_state_bytes", {}).items():
        for n, row in per_n.items():
            if "error" in row:
                lines.append(f"| {size} | {n} | error | | | |")
                continue
            lines.append(f"| {size} | {n} | {row['measured_bytes_max_rank']} | {row['formula_bytes_16P_over_N']:.0f} | "
                         f"{row['ratio_measured_over_formula']:.4f} | {row['ratio_with_step_tensors']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results.json"))
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat (~4 min)")
    parser.add_argument("--sizes", default="tiny,50m")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved launches per mode (full: 3, quick: 1)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma list of raw, shardtrain, hf, raw_head (raw + shardtrain's norm/lm_head unit), "
                             "shardtrain_glibc_malloc, shardtrain_no_shard, shardtrain_auto, shardtrain_compile, "
                             "shardtrain_shard_grad_op, shardtrain_no_shard_one_unit, "
                             "shardtrain_gloo_reduce_scatter, shardtrain_thread_arenas, shardtrain_forward_prefetch")
    parser.add_argument("--no-state", action="store_true", help="skip the model-state bytes at N = 1, 2, 4")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the results as markdown tables")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for every worker (e.g. MALLOC_MMAP_MAX_=0); recorded in config")
    cli = parser.parse_args()
    EXTRA_ENV.update(item.split("=", 1) for item in cli.env)

    steps_table = QUICK_STEPS if cli.quick else FULL_STEPS
    repeats = cli.repeats or (1 if cli.quick else 3)
    sizes = [s for s in cli.sizes.split(",") if s]
    modes = [m for m in cli.modes.split(",") if m]
    sys.path.insert(0, str(HERE))
    import torch
    from bench_common import FUSED_ADAMW, LAYER_CLASS, LEARNING_RATE, MAX_GRAD_NORM, SIZES, WEIGHT_DECAY, build_model

    started = time.perf_counter()
    results: dict[str, Any] = {"machine": machine_info(), "config": {
        "quick": cli.quick, "repeats": repeats, "extra_worker_env": dict(EXTRA_ENV),
        "ranks": 2, "backend": "gloo", "threads_per_rank": 1,
        "dtype": "float32", "optimizer": f"torch.optim.AdamW(lr={LEARNING_RATE}, weight_decay={WEIGHT_DECAY}, "
                                              f"fused={FUSED_ADAMW}); shardtrain and hf: no decay on 1-D parameters",
        "max_grad_norm": MAX_GRAD_NORM, "lr_schedule": "raw: constant; shardtrain and hf: linear decay, no warmup",
        "fsdp": {"units": LAYER_CLASS, "reshard_after_forward": True, "root_last": True,
                 "gloo_force_sum_reduction": True},
        "data": "random token ids, fixed seed, fixed length, no padding; labels = input_ids, attention_mask all 1",
        "timing": "barrier + perf_counter at the end of every step (Trainer callback on_step_end for shardtrain "
                  "and hf); median over the timed steps of all repeats, warm-up steps dropped",
        "memory": "peak RSS (ru_maxrss) minus RSS after imports and process-group init, before the model build",
        "launch": "python -m torch.distributed.run --nproc_per_node 2 --master_port <free> benchmarks/worker.py "
                  "--mode <mode> --size <size> --steps <timed> --warmup <warmup>",
        "sizes": {}}, "sizes": {}, "model_state_bytes": {}}
    with tempfile.TemporaryDirectory(prefix="shardtrain_bench_") as tmp_dir:
        tmp = Path(tmp_dir)
        for size in sizes:
            spec = SIZES[size]
            timed, warmup = steps_table[size]
            with torch.device("meta"):
                num_params = sum(p.numel() for p in build_model(spec).parameters())
            results["config"]["sizes"][size] = {**spec.as_dict(), "num_params": num_params, "timed_steps": timed,
                                                "warmup_steps": warmup,
                                                "global_batch": spec.per_device_batch * 2,
                                                "tokens_per_step": spec.per_device_batch * spec.seq_len * 2}
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            failed: set[str] = set()  # a mode that failed is not launched again (e.g. HF's CPU path)
            for repeat in range(repeats):
                for mode in modes:
                    if mode in failed:
                        continue
                    log(f"{size} {mode} repeat {repeat + 1}/{repeats}")
                    out = tmp / f"{size}_{mode}_{repeat}.json"
                    runs[mode].append(launch(["--mode", mode, "--size", size, "--steps", str(timed), "--warmup",
                                              str(warmup)], 2, out, cli.timeout))
                    if "timing" not in runs[mode][-1]:
                        log(f"  {mode} did not time: {runs[mode][-1].get('error')}")
                        failed.add(mode)
            results["sizes"][size] = {mode: pooled(runs[mode]) for mode in modes}
        for size in sizes:
            timed, warmup = steps_table[size]
            log(f"{size} single-process lower bound")
            single = launch(["--mode", "single", "--sizes", size, "--steps", str(timed), "--warmup", str(warmup)],
                            None, tmp / f"{size}_single.json", cli.timeout)
            size_result = results["sizes"][size]
            size_result["single_process_lower_bound"] = pooled([{**single[size], "launch": single["launch"]}]) \
                if size in single else {"error": single.get("error"), "stderr_tail": single.get("stderr_tail")}
            pairs = [("shardtrain", "raw"), ("shardtrain", "hf"), ("shardtrain", "raw_head"), ("raw_head", "raw"),
                     ("raw", "single_process_lower_bound"), ("shardtrain", "single_process_lower_bound"),
                     ("shardtrain", "shardtrain_glibc_malloc"), ("shardtrain_no_shard", "hf"),
                     ("shardtrain_compile", "shardtrain"), ("shardtrain", "shardtrain_gloo_reduce_scatter"),
                     ("shardtrain", "shardtrain_thread_arenas"), ("shardtrain_forward_prefetch", "shardtrain"),
                     ("shardtrain_forward_prefetch", "hf"), ("shardtrain_auto", "hf"),
                     ("shardtrain_auto", "shardtrain")]
            size_result["ratios"] = {f"{a}/{b}": ratio(size_result[a], size_result[b]) for a, b in pairs
                                     if a in size_result and b in size_result}
            bound = size_result["single_process_lower_bound"].get("step_time_s_median")
            # the efficiency measure: a mode's step / the compute a rank cannot avoid (goal <= 1.5)
            size_result["step_over_compute_bound"] = {
                mode: round(entry["step_time_s_median"] / bound, 3) for mode, entry in size_result.items()
                if isinstance(entry, dict) and entry.get("step_time_s_median") and bound
                and mode != "single_process_lower_bound"}
            # the same ratios from rank 0's CPU seconds per step (less sensitive to other load on the machine)
            size_result["ratios_cpu_time"] = {f"{a}/{b}": cpu_ratio(size_result[a], size_result[b]) for a, b in pairs
                                              if a in size_result and b in size_result}
            size_result["ratios_user_cpu_time"] = {
                f"{a}/{b}": cpu_ratio(size_result[a], size_result[b], "user_cpu_s_per_step_rank0")
                for a, b in pairs if a in size_result and b in size_result}
        if not cli.no_state:
            per_size: dict[str, dict[str, Any]] = {s: {} for s in sizes}
            # full: one launch per N (the world is the mesh); quick: one 4-rank launch, N-rank sub-meshes
            launches = [(4, ["--submeshes", "1,2,4"])] if cli.quick else [(n, []) for n in (1, 2, 4)]
            for nproc, extra in launches:
                log(f"model-state bytes on {nproc} rank(s) {' '.join(extra)}")
                state = launch(["--mode", "state", "--sizes", ",".join(sizes), *extra], nproc,
                               tmp / f"state_{nproc}.json", cli.timeout)
                for n, by_size in state.get("by_n", {}).items():
                    for size in sizes:
                        per_size[size][n] = by_size.get(size, {})
                if "error" in state:
                    for size in sizes:
                        per_size[size][f"launch_{nproc}"] = {"error": state["error"],
                                                             "stderr_tail": state.get("stderr_tail")}
            results["model_state_bytes"] = per_size
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    results["total_wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=1)
    cli.out.write_text(text + "\n")
    if cli.markdown:
        cli.markdown.write_text(markdown(results))
    print(text, flush=True)
    log(f"wrote {cli.out} in {results['total_wall_s']} s")


if __name__ == "__main__":
    main()
