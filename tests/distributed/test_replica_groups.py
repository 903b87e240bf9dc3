"""Replica groups on torchft (`fault_tolerance`): real lighthouse, real groups (each its own torchrun), real kills.

Without a failure the groups' run equals one process on the same global batch; with one group SIGKILLed mid-run,
the other commits alone, the killed group restarts and heals from its peer, and the run ends with the groups
bitwise equal and equal to one process replaying the committed record.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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


def start_group(out: Path, group: int, lighthouse: str, nproc: int = 1, min_replicas: int = 1,
                **job) -> subprocess.Popen:
    """Replica group `group` as its own torchrun job (its own session: a kill takes all its processes)."""
    ft = {"replica_group": group, "replica_groups": 2, "lighthouse": lighthouse, "recovery_host": "127.0.0.1",
          "timeout": job.pop("timeout", 15), "quorum_timeout": job.pop("quorum_timeout", 60),
          "min_replicas": min_replicas, "lost_batches": job.pop("lost_batches", "skip")}
    job = {"out": str(out), "model": TIE, "per_device_train_batch_size": 4 // nproc, "fault_tolerance": ft, **job}
    log = open(out.parent / f"{out.name}-group{group}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             str(WORKERS / "replica_run.py"), json.dumps(job)], stdout=log, stderr=subprocess.STDOUT,
                            env=worker_env(), start_new_session=True)


def finish(proc: subprocess.Popen, out: Path, group: int, timeout: float = 240) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = "timeout"
    log = (out.parent / f"{out.name}-group{group}.log").read_text()
    assert code == 0, f"group {group} ended with {code}:\n{log[-6000:]}"


def record(out: Path) -> list[dict]:
    path = out / "committed_batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(predicate, what: str, timeout: float = 120, running: tuple = ()) -> None:
    """Poll `predicate`; fail at `timeout`, or as soon as one of the `running` processes has ended."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        ended = [proc.args[-1][:200] for proc in running if proc.poll() is not None]
        assert not ended, f"waiting for {what}, a group ended: {ended}"
        time.sleep(0.1)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it (torchrun starts its workers in sessions of their own)."""
    import psutil

    parent = psutil.Process(pid)
    for proc in [*parent.children(recursive=True), parent]:
        proc.send_signal(signal.SIGKILL)


def one_process(tmp: Path, ranks: int = 1, **job) -> dict:
    """The reference: train_run.py on one process (or `ranks` without torchft), the same global batch (8 samples
    per step)."""
    from launch import torchrun

    out = tmp / f"reference{ranks}"
    torchrun(WORKERS / "train_run.py", ranks, json.dumps([{"out": str(out), "model": TIE, "weights": True,
                                                           "per_device_train_batch_size": 8 // ranks, **job}]),
             timeout=300)
    return json.loads((out / "result.json").read_text()) | {"weights": torch.load(out / "weights.pt")}


def assert_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= tol, worst


def run_groups(out: Path, nproc: int = 1, **job) -> None:
    """Both groups from the start to the end (min_replicas 2: every step is both groups')."""
    lighthouse, address = start_lighthouse(min_replicas=2)
    out.mkdir(parents=True, exist_ok=True)
    try:
        groups = [start_group(out, g, address, nproc=nproc, min_replicas=2, **job) for g in (0, 1)]
        for g, proc in enumerate(groups):
            finish(proc, out, g)
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process(tmp_path_factory.mktemp("reference"), max_steps=6)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_groups(out, max_steps=6)
    return out


@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2-fsdp"])
def test_groups_without_a_failure_equal_one_process(tmp_path, nproc, reference, uninterrupted):
    out = uninterrupted if nproc == 1 else tmp_path / "run"
    if nproc > 1:
        run_groups(out, nproc=nproc, max_steps=6)
    results = [json.loads((out / f"group{g}" / "result.json").read_text()) for g in (0, 1)]
    weights = [torch.load(out / f"group{g}" / "weights.pt") for g in (0, 1)]
    assert [s[0] for s in results[0]["steps"]] == list(range(1, 7))
    assert results[0]["steps"] == results[1]["steps"]  # every group logs the quorum's loss
    assert [s[1] for s in results[0]["steps"]] == pytest.approx(reference["losses"], abs=1e-5)
    assert [s[2] for s in results[0]["steps"]] == pytest.approx(reference["grad_norms"], abs=1e-5)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # bitwise
    assert_close(weights[0], reference["weights"], 1e-5)
    if nproc == 1:  # and the same layout without torchft: one job of 2 ranks
        plain = one_process(tmp_path, ranks=2, max_steps=6)
        assert [s[1] for s in results[0]["steps"]] == pytest.approx(plain["losses"], abs=1e-5)
        assert_close(weights[0], plain["weights"], 1e-5)
    lines = record(out)
    assert [line["step"] for line in lines] == list(range(1, 7)) and all(line["groups"] == [0, 1] for line in lines)
    assert all(len(line["samples"]) == 8 for line in lines)


def test_a_killed_group_heals_from_its_peer_and_the_run_equals_its_record(tmp_path):
    """lost_batches "refeed": the killed group's shares of the steps it missed are trained by later steps."""
    lighthouse, address = start_lighthouse(min_replicas=1)
    out = tmp_path / "run"
    out.mkdir()
    steps = 30
    job = {"max_steps": steps, "step_sleep": 0.1, "lost_batches": "refeed"}
    try:
        hold = out / "hold"
        hold.touch()  # group 0 waits after its first step until group 1 has joined (a loaded machine starts it late,
        # and group 0 alone could otherwise train every step before it)
        first = start_group(out, 0, address, hold=str(hold), **job)
        second = start_group(out, 1, address, **job)
        wait_for((out / "group1.started").exists, "group 1 to start", timeout=180, running=(first, second))
        hold.unlink()
        both = lambda: [line for line in record(out) if line["groups"] == [0, 1]]  # noqa: E731
        wait_for(lambda: len(both()) >= 3, "3 steps of both groups", running=(first, second))
        kill_tree(second.pid)  # torchrun and its worker: the whole group dies at once
        second.wait()
        killed_at = len(record(out))
        wait_for(lambda: len([line for line in record(out)[killed_at:] if line["groups"] == [0]]) >= 3,
                 "3 steps of group 0 alone", running=(first,))
        hold.touch()  # group 0 waits after its current step until group 1 is back (else it could finish first)
        (out / "group1.started").unlink()
        second = start_group(out, 1, address, **job)
        wait_for((out / "group1.started").exists, "group 1 to restart", timeout=180, running=(first, second))
        hold.unlink()
        finish(first, out, 0)
        finish(second, out, 1)
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    lines = record(out)
    assert [line["step"] for line in lines] == list(range(1, steps + 1))  # every step committed once, in order
    alone = [line["step"] for line in lines if line["groups"] == [0]]
    rejoined = [line["step"] for line in lines if line["groups"] == [0, 1] and line["step"] > max(alone)]
    assert alone and rejoined, lines  # group 0 went on alone; group 1 came back and trained again
    # every share of every step trained once: the lost ones re-fed by later steps, nothing left waiting
    trained = [(line["epoch"], line["data_step"], g) for line in lines for g in line["groups"]]
    trained += [tuple(slot) for line in lines for slot in line.get("refed", [])]
    expected = [(line["epoch"], line["data_step"], g) for line in lines for g in (0, 1)]
    assert sorted(trained) == sorted(expected) and any("refed" in line for line in lines)
    assert all(len(line["samples"]) == 4 * (len(line["groups"]) + len(line.get("refed", []))) for line in lines)
    results = [json.loads((out / f"group{g}" / "result.json").read_text()) for g in (0, 1)]
    assert results[0]["global_step"] == results[1]["global_step"] == steps
    assert results[0]["lost_slots"] == results[1]["lost_slots"] == []
    # group 1's state right after it healed, and after every later step, is bitwise group 0's
    healed = min(int(k[5:]) for k in results[1]["hashes"] if k.startswith("begin"))
    assert healed > max(alone)
    assert all(results[0]["hashes"][k] == v for k, v in results[1]["hashes"].items()), healed
    weights = [torch.load(out / f"group{g}" / "weights.pt") for g in (0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    from launch import torchrun

    replay = tmp_path / "replay"
    job = {"out": str(replay), "record": str(out / "committed_batches.jsonl"), "max_steps": steps}
    torchrun(WORKERS / "replica_replay.py", 1, json.dumps(job), timeout=300)
    replayed = {step: loss for step, loss in json.loads((replay / "result.json").read_text())["steps"]}
    logged = {step: loss for step, loss, _ in results[0]["steps"]}  # (the first steps may be group 1's alone:
    assert sorted(replayed) == list(range(1, steps + 1)) and set(alone) <= set(logged)  # whoever starts first)
    # each step group 0 trained, during the outage too, is the one-process step of the samples the record names
    assert [logged[s] for s in sorted(logged)] == pytest.approx([replayed[s] for s in sorted(logged)], abs=1e-5)
    assert_close(weights[0], torch.load(replay / "weights.pt"), 1e-5)


def test_a_group_with_another_layout_or_no_lighthouse_stops_with_one_line(tmp_path):
    lighthouse, address = start_lighthouse(min_replicas=2)
    out, alone = tmp_path / "run", tmp_path / "alone"
    out.mkdir()
    alone.mkdir()
    try:
        groups = [start_group(out, g, address, min_replicas=2, max_steps=6 + g, quorum_timeout=20) for g in (0, 1)]
        nowhere = start_group(alone, 0, "http://127.0.0.1:9", max_steps=4, quorum_timeout=3, timeout=3)
        codes = [proc.wait(timeout=120) for proc in [*groups, nowhere]]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    assert all(code != 0 for code in codes)
    for g in (0, 1):
        log = (tmp_path / f"run-group{g}.log").read_text()
        assert f"error: replica group {g}: a group of the quorum [0, 1] runs another layout" in log, log[-3000:]
    log = (tmp_path / "alone-group0.log").read_text()
    assert re.search(r"error: replica group 0: (no quorum at step 0 within 3s|cannot reach the lighthouse at "
                     r"http://127.0.0.1:9 \()", log), log[-3000:]
    assert not (out / "committed_batches.jsonl").exists()  # nothing was committed, nothing written


def test_a_whole_job_restart_after_the_lighthouse_dies_resumes_bit_identically(tmp_path, uninterrupted):
    out = tmp_path / "run"
    out.mkdir()
    hold = out / "hold"
    lighthouse, address = start_lighthouse(min_replicas=2)
    job = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3, "hold": str(hold), "hold_from": 4,
           "quorum_timeout": 5}
    hold.touch()  # both groups wait after step 4
    groups = [start_group(out, g, address, min_replicas=2, **job) for g in (0, 1)]
    try:
        wait_for(lambda: len(record(out)) >= 4, "step 4", running=groups)
        lighthouse.kill()  # the lighthouse dies: no group can form a quorum any more
        lighthouse.wait()
        hold.unlink()
        codes = [proc.wait(timeout=120) for proc in groups]
    finally:
        for proc in groups:
            if proc.poll() is None:
                kill_tree(proc.pid)
    logs = [(out.parent / f"run-group{g}.log").read_text() for g in (0, 1)]
    assert all(code != 0 for code in codes)
    for g, log in enumerate(logs):  # one line naming the lighthouse and what to check
        assert re.search(rf"error: replica group {g}: no quorum at step \d+ within 5s .*is the lighthouse at "
                         rf"{re.escape(address)} up", log), log[-3000:]
    assert (out / "checkpoint-3").is_dir()
    lighthouse, address = start_lighthouse(min_replicas=2)  # the job restarts: a new lighthouse, every group
    try:
        groups = [start_group(out, g, address, min_replicas=2, resume="auto", max_steps=6, save_strategy="steps",
                              save_steps=3) for g in (0, 1)]
        for g, proc in enumerate(groups):
            finish(proc, out, g)
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    assert [line["step"] for line in record(out)] == list(range(1, 7))  # steps after checkpoint-3: once each
    expected = torch.load(uninterrupted / "group0" / "weights.pt")
    for g in (0, 1):
        weights = torch.load(out / f"group{g}" / "weights.pt")
        assert all(torch.equal(weights[k], expected[k]) for k in expected), g
