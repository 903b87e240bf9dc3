"""Goodput at scale, on paper: restart-from-checkpoint vs replica groups (torchft), for 64 to 4,096 machines.

    python benchmarks/goodput.py                      # the table (as in docs/benchmarks.md) from the cluster costs
    python benchmarks/goodput.py --restart-s 600 --recovery-s 60 --mtbf-hours 2000 --group-machines 16
    python benchmarks/goodput.py --json               # the same as JSON, with every assumption
    python benchmarks/goodput.py --measure            # and the local costs (a lighthouse, 2 groups) beside them

A run of N machines fails somewhere at N / MTBF per hour (independent machines, Poisson). Goodput is the share of
the wall-clock time that trains samples that are kept. Every cost is a flag with a documented cluster default (not
measured on this machine, so the table does not move with its load):

- restart from checkpoint: every failure stops every machine: the failure is detected (`detection_s`), the job
  restarts (`restart_s`: scheduling, process start, loading the newest checkpoint) and trains again the steps since
  that checkpoint (half an interval on average); every checkpoint costs `save_s` of training time.
- replica groups: a failure stops its group only (N / group_machines groups). The others stall while it is
  detected (`detection_s`, the lighthouse's heartbeat timeout) and lose the step in flight (`step_s`: it does not
  commit), then go on committing steps (the dead group's share of them is not trained); the group is back after
  `restart_s` plus `recovery_s` (healing from a peer's live state, during which the peer stalls too). Each step
  pays `quorum_s` for the quorum and the commit; checkpoints are still written for whole-job restarts.

The model is an expectation (no sampling). `--measure` runs a lighthouse and two replica groups of one process here
(CPU, gloo, a tiny Llama; the second group starts while the first is at step 5, so it heals from it) and prints
what a restart, a recovery and a quorum cost on this machine beside the table; the table keeps the flags' values.
"""

from __future__ import annotations

import argparse
import json
import math


def restart_goodput(machines: int, *, mtbf_h: float, interval_s: float, save_s: float, restart_s: float,
                    detection_s: float) -> float:
    """Expected share of time training kept samples when every failure restarts the whole job."""
    rate = machines / (mtbf_h * 3600.0)  # failures per second
    lost_per_failure = detection_s + restart_s + interval_s / 2.0
    useful = interval_s / (interval_s + save_s)  # checkpoint writes stall training
    return max(0.0, useful * (1.0 - rate * lost_per_failure / useful)) if rate else useful


def replica_goodput(machines: int, *, group_machines: int, mtbf_h: float, interval_s: float, save_s: float,
                    restart_s: float, detection_s: float, recovery_s: float, quorum_s: float, step_s: float) -> float:
    """Expected share of time training kept samples when a failure stops its replica group only."""
    groups = max(1, machines // group_machines)
    if groups == 1:  # one group: a failure is a whole-job restart
        return restart_goodput(machines, mtbf_h=mtbf_h, interval_s=interval_s, save_s=save_s, restart_s=restart_s,
                               detection_s=detection_s)
    rate = machines / (mtbf_h * 3600.0)
    away = min(1.0, rate * (restart_s + recovery_s) / groups)  # expected share of the groups that are away
    stalled = min(1.0, rate * (detection_s + step_s + recovery_s))  # every group: detection, the lost step, a heal
    useful = interval_s / (interval_s + save_s)
    return useful * (1.0 - away) * (1.0 - stalled) * step_s / (step_s + quorum_s)


def measure() -> dict:
    """Run the local measurement (see the module docstring); the costs in seconds."""
    import os
    import re
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    def say(text: str) -> None:
        print(f"measure: {text}", file=sys.stderr, flush=True)

    out = Path(tempfile.mkdtemp())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDTRAIN_CPU": "1"}
    say("starting a lighthouse and replica group 0 (a tiny Llama, 40 steps)")
    lighthouse = subprocess.Popen([sys.executable, "-m", "shardtrain.cli.main", "lighthouse", "--port", "0",
                                   "--heartbeat_timeout_ms", "1500"], stdout=subprocess.PIPE, text=True, env=env)
    address = "http://127.0.0.1:" + re.search(r":(\d+) ", lighthouse.stdout.readline()).group(1)

    def group(g: int) -> subprocess.Popen:
        job = {"out": str(out), "group": g, "lighthouse": address}
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                                 __file__, "--worker", json.dumps(job)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)

    try:
        first = group(0)
        deadline = time.monotonic() + 300
        while not (out / "step5").exists():
            if time.monotonic() > deadline or first.poll() is not None:
                raise RuntimeError("replica group 0 did not reach step 5 within 300 s")
            time.sleep(0.05)
        say("group 0 is at step 5; starting group 1, which heals from it")
        launched = time.perf_counter()
        second = group(1)
        while not (out / "group1.first").exists():
            if time.monotonic() > deadline or second.poll() is not None:
                raise RuntimeError("replica group 1 did not finish its first step within 300 s")
            time.sleep(0.01)
        restart_s = time.perf_counter() - launched
        say(f"group 1 trained its first step {restart_s:.1f} s after its launch; both groups finish their 40 steps")
        logs = [proc.communicate(timeout=300)[0] for proc in (first, second)]
    finally:
        lighthouse.terminate()
    recovered = re.search(r"recovered step \d+ from a peer in ([\d.]+)s", logs[1])
    quorum = json.loads((out / "group0.json").read_text())
    return {"restart_s": round(restart_s, 2), "recovery_s": float(recovered.group(1)) if recovered else None,
            "quorum_s": round(quorum["quorum_s"] / quorum["steps"], 4), "step_s": round(quorum["step_s"], 4)}


def worker(job: dict) -> None:
    """One replica group of the measurement: a tiny Llama, 40 steps; what it saw goes to OUT."""
    import time
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtrain import Trainer, TrainerCallback, TrainingArguments

    out, g = Path(job["out"]), job["group"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (512, 32)).tolist()]
    ft = {"replica_group": g, "replica_groups": 2, "lighthouse": job["lighthouse"], "recovery_host": "127.0.0.1",
          "start_timeout": 0}  # group 1 is started late on purpose: group 0 must not wait for it
    args = TrainingArguments(output_dir=str(out), fsdp=True, per_device_train_batch_size=4, max_steps=40,
                             save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=10**9,
                             fault_tolerance=ft)
    marks: list[float] = []

    class Marks(TrainerCallback):
        def on_step_end(self, a, state, control, **k):
            marks.append(time.perf_counter())
            if g == 0 and state.global_step == 5:
                (out / "step5").touch()
            while g == 0 and state.global_step == 5 and not (out / "group1.started").exists():
                time.sleep(0.05)  # group 0 waits until group 1 has joined (it must not finish first)
            if g == 1 and len(marks) == 1:
                (out / "group1.first").touch()

        def on_train_begin(self, a, state, control, **k):
            (out / f"group{g}.started").touch()

    trainer = Trainer(model, args, train_dataset=data, callbacks=[Marks()])
    trainer.train()
    replicas = trainer._replica_gate.replicas
    steps = len(marks)
    spans = [b - a for a, b in zip(marks, marks[1:])]
    (out / f"group{g}.json").write_text(json.dumps({"quorum_s": replicas.quorum_seconds, "steps": steps,
                                                     "step_s": sorted(spans)[len(spans) // 2]}))


def table(args: argparse.Namespace) -> dict:
    rows = []
    for machines in [64 * 2 ** k for k in range(int(math.log2(4096 // 64)) + 1)]:
        costs = dict(mtbf_h=args.mtbf_hours, interval_s=args.checkpoint_interval_s, save_s=args.save_s,
                     restart_s=args.restart_s, detection_s=args.detection_s)
        restart = restart_goodput(machines, **costs)
        replicas = replica_goodput(machines, group_machines=args.group_machines, recovery_s=args.recovery_s,
                                   quorum_s=args.quorum_s, step_s=args.step_s, **costs)
        rows.append({"machines": machines, "failures_per_day": round(machines / args.mtbf_hours * 24, 2),
                     "restart_from_checkpoint": round(restart, 4), "replica_groups": round(replicas, 4)})
    assumptions = {k: v for k, v in vars(args).items() if k not in ("measure", "worker", "json")}
    return {"model": "expected goodput (share of wall-clock time training kept samples)",
            "assumptions": assumptions, "rows": rows}


def markdown(result: dict) -> str:
    """The table as docs/benchmarks.md shows it, the assumptions under it (and the local figures, if measured)."""
    lines = ["| machines | failures/day | restart from checkpoint | replica groups |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['machines']:,} | {r['failures_per_day']:.2f} | {r['restart_from_checkpoint']:.3f} | "
              f"{r['replica_groups']:.3f} |" for r in result["rows"]]
    a = result["assumptions"]
    lines += ["", f"MTBF {a['mtbf_hours']:g} h per machine, groups of {a['group_machines']} machines, a checkpoint "
              f"every {a['checkpoint_interval_s']:g} s costing {a['save_s']:g} s; restart {a['restart_s']:g} s, "
              f"detection {a['detection_s']:g} s, recovery {a['recovery_s']:g} s, quorum {a['quorum_s']:g} s per "
              f"step, step {a['step_s']:g} s (the flags; --help)"]
    if result.get("measured_locally"):
        m = result["measured_locally"]
        lines += [f"measured on this machine (CPU, gloo, a tiny Llama): restart {m['restart_s']} s, recovery "
                  f"{m['recovery_s']} s, quorum {m['quorum_s']} s per step, step {m['step_s']} s; not used above"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtbf-hours", type=float, default=5000.0, help="mean time between failures of one machine")
    p.add_argument("--group-machines", type=int, default=8, help="machines per replica group")
    p.add_argument("--checkpoint-interval-s", type=float, default=1800.0)
    p.add_argument("--save-s", type=float, default=30.0, help="training time one checkpoint save costs")
    p.add_argument("--restart-s", type=float, default=300.0,
                   help="a group's (or the job's) restart to its first step on the cluster: scheduling a "
                        "replacement, process start, loading an 8B-class checkpoint (default 300)")
    p.add_argument("--detection-s", type=float, default=5.0,
                   help="until a dead machine is noticed: the lighthouse's heartbeat timeout (default 5)")
    p.add_argument("--recovery-s", type=float, default=30.0,
                   help="healing a group from a peer's live state, an 8B-class model and optimizer (default 30)")
    p.add_argument("--quorum-s", type=float, default=0.01, help="quorum and commit per step (default 0.01)")
    p.add_argument("--step-s", type=float, default=5.0, help="one training step on the cluster (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON (the rows and every assumption) instead")
    p.add_argument("--measure", action="store_true",
                   help="also measure restart, recovery and quorum costs here (~1-2 min, with progress lines)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    result = {**table(args), "measured_locally": measure() if args.measure else None}
    print(json.dumps(result, indent=2) if args.json else markdown(result))


if __name__ == "__main__":
    main()
