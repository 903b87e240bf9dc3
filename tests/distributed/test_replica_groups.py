"""Replica groups on torchft (`fault_tolerance`): real lighthouse, real groups (each its own torchrun), real kills.

Without a failure the groups' run equals one process on the same global batch; with one group SIGKILLed mid-run,
the other commits alone, the killed group restarts and heals from its peer, and the run ends with the groups
bitwise equal and equal to one process replaying the committed record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from replica_jobs import (
    assert_close,
    finish,
    kill_tree,
    log_path,
    one_process,
    record,
    replay,
    run_groups,
    start_group,
    start_lighthouse,
    stop,
    wait_for,
)


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
        first = start_group(out, 0, address, hold=str(hold), **job)  # started together: step 1 waits for both
        second = start_group(out, 1, address, **job)
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
        stop(lighthouse)
    lines = record(out)
    assert [line["step"] for line in lines] == list(range(1, steps + 1))  # every step committed once, in order
    alone = [line["step"] for line in lines if line["groups"] == [0]]
    rejoined = [line["step"] for line in lines if line["groups"] == [0, 1] and line["step"] > max(alone)]
    assert alone and rejoined, lines  # group 0 went on alone; group 1 came back and trained again
    assert all(line["groups"] == [0, 1] for line in lines[:3])  # started together: every step together
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
    replayed = replay(out / "committed_batches.jsonl", tmp_path / "replay", steps)
    logged = {step: loss for step, loss, _ in results[0]["steps"]}
    assert sorted(replayed["losses"]) == sorted(logged) == list(range(1, steps + 1))
    # each step group 0 trained, during the outage too, is the one-process step of the samples the record names
    assert [logged[s] for s in sorted(logged)] == pytest.approx([replayed["losses"][s] for s in sorted(logged)],
                                                                abs=1e-5)
    assert_close(weights[0], replayed["weights"], 1e-5)
    # the survivor says what happened, in lines of ours; torchft's INFO lines and NCCL's are off on a gloo run
    survivor = log_path(out, 0).read_text()
    left, back = min(alone), min(rejoined)
    assert "replica groups: step 1 trains with groups [0, 1] (2 of 2)" in survivor, survivor[-3000:]
    assert f"replica groups: step {left}: group 1 left (2 -> 1 groups); its share of each step is re-fed" in survivor
    assert re.search(rf"replica groups: step {back}: group 1 rejoined \(1 -> 2 groups\); healed from a peer in "
                     r"\d+\.\d\ds", survivor), survivor[-3000:]
    assert "[INFO]" not in survivor and "flight recorder" not in survivor, survivor[:3000]


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
        stop(lighthouse)
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
        groups = [start_group(out, g, address, min_replicas=2, max_steps=6, save_strategy="steps", save_steps=3)
                  for g in (0, 1)]  # (no resume argument: a group resumes from the job's newest checkpoint)
        for g, proc in enumerate(groups):
            finish(proc, out, g)
    finally:
        stop(lighthouse)
    assert [line["step"] for line in record(out)] == list(range(1, 7))  # steps after checkpoint-3: once each
    expected = torch.load(uninterrupted / "group0" / "weights.pt")
    for g in (0, 1):
        weights = torch.load(out / f"group{g}" / "weights.pt")
        assert all(torch.equal(weights[k], expected[k]) for k in expected), g
