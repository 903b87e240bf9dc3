"""Replica groups as operators run them: the job's state is its output directory, a group never goes back in it,
a group lives and dies with its launcher.

Each test starts real groups against a real lighthouse and kills real processes; each wait names what it waited
for. The survivors' log lines and the start together are asserted in test_replica_groups.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
from replica_jobs import finish, kill_tree, log_path, record, start_group, start_lighthouse, stop, tree_digest, wait_for


def job_files(out) -> dict[str, str]:
    """The job's own files (checkpoints, the record, the metrics log), byte by byte; not the tests' result files."""
    return {path: digest for path, digest in tree_digest(out).items() if not path.startswith("group")}


def test_a_group_restarted_after_the_job_finished_exits_0_and_changes_nothing(tmp_path):
    lighthouse, address = start_lighthouse()
    out = tmp_path / "run"
    out.mkdir()
    job = {"max_steps": 12, "save_strategy": "steps", "save_steps": 4, "step_sleep": 0.05}
    try:
        first, second = (start_group(out, g, address, **job) for g in (0, 1))
        wait_for(lambda: len(record(out)) >= 2, "2 steps of both groups", running=(first, second))
        kill_tree(second.pid)
        finish(first, out, 0)  # group 0 finishes the job alone
        before = job_files(out)
        assert [line["step"] for line in record(out)] == list(range(1, 13))
        assert {f"checkpoint-{s}" for s in (4, 8, 12)} <= {path.split("/")[0] for path in before}
        log_path(out, 1).write_text("")
        again = start_group(out, 1, address, **job)  # as a Slurm retry loop or a requeue restarts it
        finish(again, out, 1, timeout=180)
    finally:
        stop(lighthouse)
    log = log_path(out, 1).read_text()
    assert "replica group 1: the job finished at step 12" in log, log[-3000:]
    assert job_files(out) == before  # every checkpoint and the record byte-identical
    assert not (out / "group1").exists()  # it trained nothing (its result file is written after train())


def test_a_record_that_no_checkpoint_backs_is_never_trained_over(tmp_path):
    """Every group died and no checkpoint was saved: a restart from step 0 would write steps 1..3 again."""
    lighthouse, address = start_lighthouse()
    out = tmp_path / "run"
    out.mkdir()
    lines = [{"step": s, "epoch": 0, "data_step": s - 1, "groups": [0], "samples": [s]} for s in (1, 2, 3)]
    (out / "committed_batches.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = job_files(out)
    try:
        alone = start_group(out, 0, address, groups=1, max_steps=6)
        code = alone.wait(timeout=180)
    finally:
        stop(lighthouse)
    log = log_path(out, 0).read_text()
    assert code != 0
    assert "holds steps 1..3, but no running group holds them" in log and "nothing was written" in log, log[-3000:]
    assert job_files(out) == before


def test_a_killed_launcher_takes_its_group_and_the_others_finish(tmp_path):
    lighthouse, address = start_lighthouse()
    out = tmp_path / "run"
    out.mkdir()
    job = {"max_steps": 16, "step_sleep": 0.1}
    try:
        first = start_group(out, 0, address, **job)
        launched = start_group(out, 1, address, launcher=True, **job)  # `shardtrain launch --replica_group_id 1`
        wait_for(lambda: len(record(out)) >= 3, "3 steps of both groups", running=(first, launched))
        workers = psutil.Process(launched.pid).children(recursive=True)
        assert workers, "the launcher has no worker"
        os.kill(launched.pid, signal.SIGKILL)  # the launcher alone; its workers are in sessions of their own
        launched.wait()
        deadline = time.monotonic() + 10
        while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
            assert time.monotonic() < deadline, f"the workers of a killed launcher still run after 10 s: {workers}"
            time.sleep(0.1)
        finish(first, out, 0)
    finally:
        stop(lighthouse)
        for w in workers if "workers" in locals() else ():
            kill_tree(w.pid)
    lines = record(out)
    assert [line["step"] for line in lines] == list(range(1, 17))
    assert lines[0]["groups"] == [0, 1] and lines[-1]["groups"] == [0]  # group 1 ended whole, group 0 went on
    log = log_path(out, 0).read_text()
    assert "group 1 left (2 -> 1 groups)" in log, log[-3000:]
