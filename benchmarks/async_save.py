"""How long a checkpoint save blocks the training loop: synchronous vs `save_async=True`, side by side.

    .venv/bin/python benchmarks/async_save.py --repeats 2 --out benchmarks/results/async_save.json  # 50m, ~3 min
    .venv/bin/python benchmarks/async_save.py --size tiny --steps 8 --save-every 2 --out /tmp/a.json
    .venv/bin/python benchmarks/async_save.py --repeats 2 --kinds SHARDED_STATE_DICT --out /tmp/a.json

One `python -m torch.distributed.run --nproc_per_node 2` launch of this file (`--worker`, gloo,
OMP_NUM_THREADS=1 per rank) trains the benchmark's Llama (`bench_common.SIZES`, the Trainer settings of
`worker.py`'s shardtrain mode) `--steps` steps with a checkpoint every `--save-every` steps, for each state
dict type (`FULL_STATE_DICT`, `SHARDED_STATE_DICT`) in sync then async mode (interleaved `--repeats` times),
into a scratch directory on the same disk as `--dir` (default: the system temp dir), `save_total_limit=1`.

Measured per save, on every rank, by timing `CheckpointManager.save` / `save_async` / `wait`:
  * sync `blocked_s`: the wall time of `save` (write, fsync, rename, rotate).
  * async `blocked_s`: the wall time of `save_async` without the wait for the previous save inside it
    (`launch_s`: stage, small files, start the background part), plus the wait that commits this save
    (`wait_s`: at the next save or at the end of `train()`); `background_s`: from the end of `save_async`
    until its background part (DCP write, safetensors, commit) was done.
  * the maximum over ranks is reported (a rank that is blocked holds up the other at the next collective);
    the ranks pass a barrier just before `save` / `save_async` is timed, so their skew from the training
    step is not counted in either mode.
`stall` = sum of async blocked / sum of sync blocked over all saves (first saves included: they create the
gloo group and the staging buffers); `stall_after_first_save` leaves the first save of each run out.
Step times (between `on_step_end` marks after a barrier, as in `worker.py`): steps without a save call and
without a save in flight, and (async) steps that started while a save was in flight;
`in_flight_extra_s_per_save` is what those steps took beyond the median plain step, per save, and
`stall_incl_slower_steps` adds it to the async blocked time. Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KINDS = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
MODES = ("sync", "async")


# -- the worker (one process per rank) -------------------------------------------------------------------
class SaveTimer:
    """Times CheckpointManager.save / save_async / wait on this rank (patched on the class)."""

    def __init__(self) -> None:
        from shardtrain.checkpoint.manager import CheckpointManager
        from shardtrain.parallel.distributed import barrier

        self.events: list[dict[str, Any]] = []
        self.done: dict[int, float] = {}
        originals = {name: getattr(CheckpointManager, name) for name in ("save", "save_async", "wait")}
        timer = self

        def wrap(name: str) -> Any:
            original = originals[name]

            def timed(manager: Any, *args: Any, **kwargs: Any) -> Any:
                pending = manager.in_flight.step if manager.in_flight is not None else None
                step = args[0] if args else kwargs.get("step")
                if name != "wait":  # start together: the ranks' skew from the step is not the save's cost
                    barrier()
                started = time.perf_counter()
                try:
                    return original(manager, *args, **kwargs)
                finally:
                    ended = time.perf_counter()
                    timer.events.append({"event": name, "step": pending if name == "wait" else step,
                                         "t0": started, "t1": ended})
                    if name == "save_async" and manager.in_flight is not None:
                        manager.in_flight.future.add_done_callback(
                            lambda _, s=step: timer.done.__setitem__(s, time.perf_counter()))

            return timed

        for name in originals:
            setattr(CheckpointManager, name, wrap(name))

    def reset(self) -> None:
        self.events, self.done = [], {}

    def per_save(self) -> list[dict[str, Any]]:
        """blocked / launch / wait / background seconds of every save of the last run on this rank."""
        out = []
        waits = [e for e in self.events if e["event"] == "wait" and e["step"] is not None]
        for event in self.events:
            if event["event"] == "save":
                out.append({"step": event["step"], "blocked_s": event["t1"] - event["t0"]})
            elif event["event"] == "save_async":
                inner = sum(w["t1"] - w["t0"] for w in waits if event["t0"] <= w["t0"] and w["t1"] <= event["t1"])
                launch = event["t1"] - event["t0"] - inner
                wait = sum(w["t1"] - w["t0"] for w in waits if w["step"] == event["step"])
                done = self.done.get(event["step"])
                out.append({"step": event["step"], "blocked_s": launch + wait, "launch_s": launch, "wait_s": wait,
                            "background_s": None if done is None else done - event["t1"]})
        return out


def run_one(cli: argparse.Namespace, spec: Any, samples: list, kind: str, mode: str, out_dir: Path,
            timer: SaveTimer) -> dict[str, Any]:
    import torch.distributed as dist
    from bench_common import (
        FUSED_ADAMW,
        LAYER_CLASS,
        LEARNING_RATE,
        MAX_GRAD_NORM,
        SEED,
        WEIGHT_DECAY,
        StepTimer,
        build_model,
        gather_to_rank0,
    )

    from shardtrain import Trainer, TrainingArguments
    from shardtrain.train.state import TrainerCallback

    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
    dist.barrier()
    steps = StepTimer()
    in_flight: list[bool] = []  # at each mark: was a save's background part still running?
    holder: dict[str, Any] = {}

    def flight() -> bool:
        manager = getattr(holder["trainer"], "_checkpoint_manager", None)
        pending = manager.in_flight if manager is not None else None
        return pending is not None and not pending.future.done()

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            steps.mark()
            in_flight.append(False)

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            steps.mark()
            in_flight.append(flight())

    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=spec.per_device_batch, max_steps=cli.steps,
        learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type="linear", warmup_steps=0, seed=SEED, logging_steps=10**9, report_to="none",
        disable_tqdm=True, fsdp=True, optim="adamw_torch_fused" if FUSED_ADAMW else "adamw_torch",
        save_strategy="steps", save_steps=cli.save_every, save_total_limit=1, save_async=mode == "async",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [LAYER_CLASS], "reshard_after_forward": True,
                     "state_dict_type": kind})
    trainer = Trainer(build_model(spec), args, train_dataset=samples, callbacks=[Marks()])
    holder["trainer"] = trainer
    timer.reset()
    started = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - started
    saves = gather_to_rank0(timer.per_save())
    durations = steps.durations()
    result: dict[str, Any] = {}
    if rank == 0:
        save_steps = {s["step"] for s in saves[0]}
        # step i (1-based) lasts from mark i-1 to mark i; it holds a save call when i is a save step
        plain = [d for i, d in enumerate(durations, 1) if i > 1 and i not in save_steps and not in_flight[i - 1]]
        flying = [d for i, d in enumerate(durations, 1) if i not in save_steps and in_flight[i - 1]]
        merged = []
        for per_rank in zip(*saves, strict=True):
            row = {"step": per_rank[0]["step"], "blocked_s": max(r["blocked_s"] for r in per_rank),
                   "blocked_s_per_rank": [round(r["blocked_s"], 4) for r in per_rank]}
            for key in ("launch_s", "wait_s", "background_s"):
                if key in per_rank[0]:
                    values = [r[key] for r in per_rank if r[key] is not None]
                    row[key] = round(max(values), 4) if values else None
            row["blocked_s"] = round(row["blocked_s"], 4)
            merged.append(row)
        last = out_dir / f"checkpoint-{max(save_steps)}"
        result = {"kind": kind, "mode": mode, "saves": merged, "train_wall_s": round(train_wall, 2),
                  "checkpoint_bytes": sum(p.stat().st_size for p in last.rglob("*") if p.is_file()),
                  "step_times_s": [round(d, 4) for d in durations], "in_flight_at_start": in_flight[:-1],
                  "plain_steps_s": [round(d, 4) for d in plain], "in_flight_steps_s": [round(d, 4) for d in flying],
                  "tmp_dirs_left": sorted(p.name for p in out_dir.iterdir() if p.name.startswith(".tmp"))}
        shutil.rmtree(out_dir, ignore_errors=True)
    dist.barrier()
    return result


def worker(cli: argparse.Namespace) -> None:
    import torch.distributed as dist
    from bench_common import SIZES, make_samples

    from shardtrain.parallel.distributed import destroy_distributed, init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = SIZES[cli.size]
    samples = make_samples(spec, cli.steps * spec.per_device_batch * world)
    timer = SaveTimer()
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(cli.repeats):
            for kind in cli.kinds.split(","):
                for mode in MODES:
                    if rank == 0:
                        print(f"[async_save {time.strftime('%H:%M:%S')}] {kind} {mode} repeat {repeat}",
                              file=sys.stderr, flush=True)
                    run = run_one(cli, spec, samples, kind, mode, Path(cli.dir) / f"{kind}-{mode}", timer)
                    runs.append({**run, "repeat": repeat})
    except Exception:
        if rank == 0:
            cli.out.write_text(json.dumps({"error": traceback.format_exc()[-4000:]}))
        raise
    if rank == 0:
        cli.out.write_text(json.dumps({"size": spec.as_dict(), "world_size": world, "runs": runs}))
    destroy_distributed()


# -- the launcher -----------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import platform

    import psutil
    import torch
    import transformers

    cpuinfo = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")), "") if cpuinfo.exists() else platform.processor()
    return {"logical_cores": os.cpu_count(), "cpu_model": model,
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "load_avg_at_start": os.getloadavg()}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def summarize(runs: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in kinds:
        by_mode = {mode: [r for r in runs if r["kind"] == kind and r["mode"] == mode] for mode in MODES}
        blocked = {mode: [s["blocked_s"] for r in by_mode[mode] for s in r["saves"]] for mode in MODES}
        later = {mode: [s["blocked_s"] for r in by_mode[mode] for s in r["saves"][1:]] for mode in MODES}
        plain = [d for mode in MODES for r in by_mode[mode] for d in r["plain_steps_s"]]
        flying = [d for r in by_mode["async"] for d in r["in_flight_steps_s"]]
        plain_median = statistics.median(plain) if plain else 0.0
        n_async = len(blocked["async"])
        extra = sum(d - plain_median for d in flying) / n_async if n_async else 0.0
        async_runs = by_mode["async"]
        out[kind] = {
            "stall": _ratio(sum(blocked["async"]), sum(blocked["sync"])),
            "stall_after_first_save": _ratio(sum(later["async"]), sum(later["sync"])),
            "stall_median": _ratio(statistics.median(blocked["async"]), statistics.median(blocked["sync"])),
            "stall_incl_slower_steps": _ratio(sum(blocked["async"]) + extra * n_async, sum(blocked["sync"])),
            "sync_blocked_s_per_save": blocked["sync"], "async_blocked_s_per_save": blocked["async"],
            "async_launch_s_per_save": [s["launch_s"] for r in async_runs for s in r["saves"]],
            "async_wait_s_per_save": [s["wait_s"] for r in async_runs for s in r["saves"]],
            "async_background_s_per_save": [s["background_s"] for r in async_runs for s in r["saves"]],
            "step_time_s_median_no_save": round(plain_median, 4),
            "step_time_s_median_save_in_flight": round(statistics.median(flying), 4) if flying else None,
            "steps_no_save": len(plain), "steps_save_in_flight": len(flying),
            "in_flight_extra_s_per_save": round(extra, 4),
            "checkpoint_bytes": by_mode["sync"][0]["checkpoint_bytes"] if by_mode["sync"] else None,
            "train_wall_s": {mode: [r["train_wall_s"] for r in by_mode[mode]] for mode in MODES},
            "tmp_dirs_left": sorted({t for mode in MODES for r in by_mode[mode] for t in r["tmp_dirs_left"]}),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="50m", help="bench_common.SIZES key (tiny | 50m)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run")
    parser.add_argument("--save-every", type=int, default=3, help="save_steps")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats of sync / async")
    parser.add_argument("--kinds", default=",".join(KINDS), help="state dict types, comma separated")
    parser.add_argument("--dir", default=None, help="scratch parent directory for the checkpoints")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    from compare import cpu_busy_percent, free_port, worker_env

    scratch = Path(tempfile.mkdtemp(prefix="async-save-bench-", dir=cli.dir))
    raw = scratch / "worker.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(Path(__file__).resolve()), "--worker", "--size", cli.size,
           "--steps", str(cli.steps), "--save-every", str(cli.save_every), "--repeats", str(cli.repeats),
           "--kinds", cli.kinds, "--dir", str(scratch / "runs"), "--out", str(raw)]
    busy = cpu_busy_percent()
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, check=False)
        data = json.loads(raw.read_text()) if raw.exists() else {"error": proc.stderr[-4000:]}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if "runs" not in data:
        print(json.dumps(data, indent=1))
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    kinds = cli.kinds.split(",")
    result = {
        "benchmark": "async_save", "command": " ".join(["python", "benchmarks/async_save.py", *sys.argv[1:]]),
        "config": {"size": data["size"], "world_size": data["world_size"], "steps": cli.steps,
                   "save_every": cli.save_every, "repeats": cli.repeats, "save_total_limit": 1,
                   "scratch_filesystem_of": str(cli.dir or tempfile.gettempdir())},
        "machine": machine_info(), "cpu_busy_percent_before_launch": busy,
        "launch_wall_s": round(time.perf_counter() - started, 1),
        "summary": summarize(data["runs"], kinds), "runs": data["runs"],
    }
    text = json.dumps(result, indent=1)
    cli.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
