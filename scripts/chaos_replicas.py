"""A seeded chaos run of replica groups: SIGKILLs at random moments, then proof that nothing was lost or done twice.

    .venv/bin/python scripts/chaos_replicas.py --seed 0 --out /tmp/chaos      # ~3-4 min on 2 cores; prints JSON

Three groups of one process each (`shardtrain launch --replica_group_id I`, lost_batches "refeed") train a tiny
Llama for 60 steps against one lighthouse, a checkpoint every 5 steps. At steps drawn from the seed, the run kills:
a group in a step; the writing group during a checkpoint save; a group while it heals; a launcher alone; every
group at once (the whole job restarts from its newest checkpoint). Each killed group is restarted after a random
delay, as an operator's retry loop does. After the job ends, one group is restarted once more: it must exit 0 with
`the job finished at step 60` and change no file.

Then one process replays the record (`committed_batches.jsonl`) and the run is judged: every step committed once,
every share (epoch, step, group) trained exactly once, the final weights and every checkpoint equal the replay's
(1e-5), no group failed on its own. The JSON has the kills by kind, the recoveries and the differences.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "distributed" / "workers"
KINDS = ("step", "save", "recovery", "launcher", "all")


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SHARDTRAIN_CPU="1",
                PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """The lighthouse, the groups' processes and the files of one chaos run."""

    def __init__(self, out: Path, groups: int, steps: int, save_steps: int, step_sleep: float) -> None:
        self.out, self.groups, self.steps = out, groups, steps
        self.job = {"out": str(out / "run"), "model": "llama_tied", "per_device_train_batch_size": 4,
                    "max_steps": steps, "save_strategy": "steps", "save_steps": save_steps, "step_sleep": step_sleep,
                    "hold": str(out / "run" / "hold"),
                    "fault_tolerance": {"recovery_host": "127.0.0.1", "timeout": 10, "quorum_timeout": 120,
                                        "lost_batches": "refeed", "start_timeout": 60}}
        self.run_dir = out / "run"
        self.hold = self.run_dir / "hold"  # while it exists, every group waits after each step (replica_run.py)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[int, subprocess.Popen] = {}
        self.planned: set[int] = set()  # pids this run killed
        self.pending: list[tuple[float, int]] = []  # (when, group): restarts due
        self.unplanned: list[str] = []  # groups that ended non-zero on their own
        self.starts = 0
        self.lighthouse = subprocess.Popen(
            [sys.executable, "-m", "shardtrain.cli.main", "lighthouse", "--port", "0", "--heartbeat_timeout_ms",
             "1500"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
        line = self.lighthouse.stdout.readline()
        port = re.search(r":(\d+) ", line)
        assert port, f"the lighthouse said {line!r}"
        self.address = f"http://127.0.0.1:{port.group(1)}"

    def start(self, group: int) -> None:
        log = open(self.out / f"group{group}.log", "a")
        command = [sys.executable, "-m", "shardtrain.cli.main", "launch", "--cpu", "--num_processes", "1",
                   "--main_process_port", str(_free_port()), "--replica_group_id", str(group), "--num_replica_groups",
                   str(self.groups), "--lighthouse", self.address, str(WORKERS / "replica_run.py"),
                   json.dumps({**self.job, "group": group})]
        self.started_file(group).unlink(missing_ok=True)
        self.procs[group] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                             start_new_session=True)
        self.starts += 1

    def started_file(self, group: int) -> Path:
        return self.run_dir / f"group{group}.started"

    def alive(self) -> list[int]:
        return [g for g, p in self.procs.items() if p.poll() is None]

    def kill(self, group: int, launcher_only: bool = False) -> None:
        """SIGKILL the group's launcher and workers, or its launcher alone (whose workers must then end by
        themselves within 10 s: the parent-death signal)."""
        import psutil

        proc = self.procs[group]
        self.planned.add(proc.pid)
        workers = _children(proc.pid)
        for target in [proc] if launcher_only else [*workers, proc]:
            try:
                os.kill(target.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
            if time.monotonic() > deadline:
                raise AssertionError(f"group {group}'s workers outlived their launcher by 10 s")
            time.sleep(0.1)

    def reap(self) -> None:
        """Groups that ended non-zero without being killed are noted and restarted, as a retry loop would."""
        for g, p in self.procs.items():
            code = p.poll()
            if code not in (None, 0) and p.pid not in self.planned and f"{g}:{p.pid}" not in self.unplanned:
                self.unplanned.append(f"{g}:{p.pid}")
                self.pending.append((time.monotonic() + 1.0, g))

    def restart_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for item in sorted(self.pending):
            when, group = item
            if (when <= now or force) and self.procs[group].poll() is not None:
                self.pending.remove(item)
                self.start(group)

    def record(self) -> list[dict]:
        path = self.run_dir / "committed_batches.jsonl"
        lines = []
        for text in path.read_text().splitlines() if path.is_file() else []:
            try:
                lines.append(json.loads(text))
            except ValueError:
                continue
        return lines

    def last_step(self) -> int:
        return max((line["step"] for line in self.record()), default=0)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                for pid in [c.pid for c in _children(proc.pid)] + [proc.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self.lighthouse.terminate()
        self.lighthouse.wait(timeout=30)


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_until(predicate, what: str, timeout: float, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        job.reap()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def chaos(seed: int, out: Path, groups: int = 3, steps: int = 60, save_steps: int = 5,
          step_sleep: float = 0.3) -> dict:
    """Run the seeded chaos job under `out` and judge it; the figures as a dict (see the module docstring)."""
    rng = random.Random(seed)
    plan = ["step", "step", "save", "save", "recovery", "recovery", "launcher", "launcher", "all"]
    rng.shuffle(plan)
    triggers = sorted(rng.sample(range(3, steps - 8), len(plan)))
    job = Job(out, groups, steps, save_steps, step_sleep)
    kills = {kind: 0 for kind in KINDS} | {"after_finish": 0}
    events: list[dict] = []
    started = time.monotonic()
    try:
        for g in range(groups):
            job.start(g)
        for kind, trigger in zip(plan, triggers):
            wait_until(lambda t=trigger: job.last_step() >= t, f"step {trigger}", 300, job)
            live = job.alive()
            victims = live if kind == "all" else [rng.choice(live)]
            if kind == "save":  # the writer (the lowest group of the quorum) while a checkpoint is being written
                if not _wait_tmp_checkpoint(job, timeout=2 * save_steps * step_sleep + 30):
                    kind = "step"
                victims = [min(job.alive())]
            if kind in ("step", "recovery"):
                time.sleep(rng.uniform(0.0, step_sleep))  # a random moment of a step
            at = job.last_step()
            for v in victims:
                job.kill(v, launcher_only=kind == "launcher")
                kills["step" if kind == "recovery" else kind] += 1
            if kind != "all":  # the others go on alone for a few steps, then wait while the group restarts
                target = at + rng.randint(1, 3)
                wait_until(lambda t=target: job.last_step() >= t, f"step {target} without group {victims}", 120, job)
                job.hold.touch()
            time.sleep(rng.uniform(0.5, 2.0))  # the operator's (or the scheduler's) delay
            _restart(job, victims)
            if kind == "recovery":  # and once more while it joins the quorum and heals from a peer
                job.hold.unlink()
                time.sleep(rng.uniform(0.0, 0.5))
                job.kill(victims[0])
                kills["recovery"] += 1
                job.hold.touch()
                _restart(job, victims)
            job.hold.unlink(missing_ok=True)
            wait_until(lambda: (job.record() or [{}])[-1].get("groups") == list(range(groups)),
                       "every group training together again", 240, job)
            events.append({"kind": kind, "at_step": at, "groups": victims})
        deadline = time.monotonic() + 600
        while job.last_step() < steps or job.pending or job.alive():
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not finish within 600 s (step {job.last_step()})")
            job.restart_due(force=not job.alive() and job.last_step() < steps)
            job.reap()
            time.sleep(0.1)
        job.reap()
        before = _job_files(job.run_dir)
        late = rng.randrange(groups)  # restarted after the job finished: exits 0, changes nothing
        job.start(late)
        code = job.procs[late].wait(timeout=180)
        kills["after_finish"] = 1
        finished_line = f"replica group {late}: the job finished at step {steps}" in \
            (out / f"group{late}.log").read_text()
        unchanged = _job_files(job.run_dir) == before
    finally:
        job.close()
    result = {"seed": seed, "groups": groups, "steps": steps, "kills": kills, "kills_total": sum(kills.values()),
              "starts": job.starts, "events": events, "unplanned_failures": job.unplanned,
              "late_restart": {"exit_code": code, "said_finished": finished_line, "files_unchanged": unchanged},
              "seconds": round(time.monotonic() - started, 1)}
    return result | judge(job.run_dir, out, groups=groups, steps=steps, save_steps=save_steps)


def _restart(job: Job, victims: list[int]) -> None:
    for v in victims:
        job.start(v)
    wait_until(lambda: all(job.started_file(v).exists() for v in victims), f"groups {victims} to restart", 180,
               job)


def _wait_tmp_checkpoint(job: Job, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.startswith(".tmp-checkpoint-") for p in job.run_dir.iterdir()):
            return True
        time.sleep(0.01)
    return False


def _job_files(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.relative_to(root).parts[0].startswith("group")}


def judge(run_dir: Path, out: Path, *, groups: int, steps: int, save_steps: int) -> dict:
    """The record against itself, the groups' final weights and checkpoints against one process replaying it."""
    import torch

    lines = [json.loads(text) for text in (run_dir / "committed_batches.jsonl").read_text().splitlines()]
    committed = [line["step"] for line in lines]
    trained = sorted([(line["epoch"], line["data_step"], g) for line in lines for g in line["groups"]]
                     + [tuple(slot) for line in lines for slot in line.get("refed", [])])
    expected = sorted((line["epoch"], line["data_step"], g) for line in lines for g in range(groups))
    replay_dir = out / "replay"
    replay_job = {"out": str(replay_dir), "record": str(run_dir / "committed_batches.jsonl"), "max_steps": steps,
                  "save_strategy": "steps", "save_steps": save_steps}
    subprocess.run([sys.executable, str(WORKERS / "replica_replay.py"), json.dumps(replay_job)], env=_env(),
                   check=True, capture_output=True, timeout=600)
    reference = torch.load(replay_dir / "weights.pt")
    finals = [torch.load(p) for p in sorted(run_dir.glob("group*/weights.pt"))]

    def worst(a: dict, b: dict) -> float:
        return max((a[k].double() - b[k].double()).abs().max().item() for k in b)

    checkpoints = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    checkpoint_diff = {}
    for path in checkpoints:
        state = json.loads((path / "trainer_state.json").read_text())
        checkpoint_diff[path.name] = {"step_ok": state["global_step"] == int(path.name.split("-")[1]),
                                      "max_abs_diff": worst(_model(path), _model(replay_dir / path.name))}
    return {"committed_steps": len(committed), "every_step_once": committed == list(range(1, steps + 1)),
            "every_share_once": trained == expected, "refed_shares": sum(len(line.get("refed", [])) for line in lines),
            "steps_without_all_groups": sum(len(line["groups"]) < groups for line in lines),
            "final_models": len(finals),
            "final_weights_max_abs_diff": max((worst(f, reference) for f in finals), default=None),
            "checkpoints": checkpoint_diff,
            "recoveries": sum(open(p).read().count("recovered step") for p in out.glob("group*.log"))}


def _model(checkpoint: Path) -> dict:
    """A checkpoint's whole model, sharded (DCP) or full (model.safetensors)."""
    from safetensors.torch import load_file

    from shardtrain.checkpoint.merge import load_sharded_model

    if (checkpoint / "sharded").is_dir():
        return load_sharded_model(checkpoint)
    return load_file(checkpoint / "model.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="a new or empty directory for the run's files")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--groups", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(chaos(args.seed, args.out, groups=args.groups, steps=args.steps), indent=2))


if __name__ == "__main__":
    main()
