"""Replica-group jobs for the tests: a real lighthouse, real groups (each its own torchrun or `shardtrain launch`),
real kills. Every wait has a deadline that names what it waited for."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from launch import worker_env

WORKERS = Path(__file__).parent / "workers"
TIE = "llama_tied"


def start_lighthouse(min_replicas: int = 1) -> tuple[subprocess.Popen, str]:
    """`shardtrain lighthouse` on a free port; (process, address)."""
    proc = subprocess.Popen([sys.executable, "-m", "shardtrain.cli.main", "lighthouse", "--port", "0",
                             "--min_replicas", str(min_replicas), "--heartbeat_timeout_ms", "1500"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=worker_env())
    line = proc.stdout.readline()
    port = re.search(r":(\d+) ", line)
    assert port, f"the lighthouse said {line!r}"
    return proc, f"http://127.0.0.1:{port.group(1)}"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def log_path(out: Path, group: int) -> Path:
    return out.parent / f"{out.name}-group{group}.log"


def start_group(out: Path, group: int, lighthouse: str, nproc: int = 1, min_replicas: int = 1, groups: int = 2,
                launcher: bool = False, **job) -> subprocess.Popen:
    """Replica group `group` of `groups` as its own torchrun job, or `shardtrain launch` with its replica flags
    (`launcher`), in a session of its own (a kill of the session takes all its processes)."""
    ft = {"recovery_host": "127.0.0.1", "timeout": job.pop("timeout", 15),
          "quorum_timeout": job.pop("quorum_timeout", 60), "min_replicas": min_replicas,
          "lost_batches": job.pop("lost_batches", "skip"), "start_timeout": job.pop("start_timeout", 120)}
    if not launcher:
        ft |= {"replica_group": group, "replica_groups": groups, "lighthouse": lighthouse}
    job = {"out": str(out), "model": TIE, "per_device_train_batch_size": 4 // nproc, "fault_tolerance": ft,
           "group": group, **job}
    log = open(log_path(out, group), "a")
    if launcher:
        command = [sys.executable, "-m", "shardtrain.cli.main", "launch", "--cpu", "--num_processes", str(nproc),
                   "--main_process_port", str(free_port()), "--replica_group_id", str(group),
                   "--num_replica_groups", str(groups), "--lighthouse", lighthouse]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.Popen([*command, str(WORKERS / "replica_run.py"), json.dumps(job)], stdout=log,
                            stderr=subprocess.STDOUT, env=worker_env(), start_new_session=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish(proc: subprocess.Popen, out: Path, group: int, timeout: float = 240) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        code = f"still running after {timeout:g}s"
    log = log_path(out, group).read_text()
    assert code == 0, f"group {group} ended with {code}:\n{log[-6000:]}"


def record(out: Path) -> list[dict]:
    path = out / "committed_batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(predicate, what: str, timeout: float = 120, running: tuple = ()) -> None:
    """Poll `predicate`; fail at `timeout`, or as soon as one of the `running` processes has ended."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        ended = [proc.args[-1][:200] for proc in running if proc.poll() is not None]
        assert not ended, f"waiting for {what}, a group ended: {ended}"
        time.sleep(0.1)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it (torchrun starts its workers in sessions of their own)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def one_process(tmp: Path, ranks: int = 1, **job) -> dict:
    """The reference: train_run.py on one process (or `ranks` without torchft), the same global batch (8 samples
    per step)."""
    from launch import torchrun

    out = tmp / f"reference{ranks}"
    torchrun(WORKERS / "train_run.py", ranks, json.dumps([{"out": str(out), "model": TIE, "weights": True,
                                                           "per_device_train_batch_size": 8 // ranks, **job}]),
             timeout=300)
    return json.loads((out / "result.json").read_text()) | {"weights": torch.load(out / "weights.pt")}


def replay(record_file: Path, out: Path, steps: int) -> dict:
    """One process trained on exactly the samples of `record_file`, step by step: its losses and weights."""
    from launch import torchrun

    job = {"out": str(out), "record": str(record_file), "max_steps": steps}
    torchrun(WORKERS / "replica_replay.py", 1, json.dumps(job), timeout=300)
    steps_logged = json.loads((out / "result.json").read_text())["steps"]
    return {"losses": {step: loss for step, loss in steps_logged}, "weights": torch.load(out / "weights.pt")}


def assert_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= tol, worst


def run_groups(out: Path, nproc: int = 1, **job) -> None:
    """Both groups started together with the documented min_replicas 1, from the start to the end."""
    lighthouse, address = start_lighthouse(min_replicas=1)
    out.mkdir(parents=True, exist_ok=True)
    try:
        groups = [start_group(out, g, address, nproc=nproc, **job) for g in (0, 1)]
        for g, proc in enumerate(groups):
            finish(proc, out, g)
    finally:
        stop(lighthouse)


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` by relative path: equal digests, byte-identical trees."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
