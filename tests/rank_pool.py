"""Rank processes started once per test session and reused: a multi-rank case costs its own work, not a launch.

    pool = RankPool(2)                    # started on first use: torchrun, 2 ranks, one process group
    done = pool.run(script, ["ours", out], env=worker_env(), timeout=600)   # a subprocess.CompletedProcess
    pool.stop()

Each case runs in every rank of the pool as that rank of `torchrun SCRIPT ARGS` would (`rank_pool_server.py`
says what is reset between cases); its output and exit code come back as a `subprocess.CompletedProcess`. A case
that fails or hangs is reported with every rank's output (tracebacks included), and the pool is stopped: the
next case starts a new one. `launch.torchrun` / `launch.python` send runs that are expected to succeed here;
runs whose launch, exit or crash is under test start real processes (`pooled=False`).
SHARDTRAIN_TEST_POOL=0 turns the pool off: every run is then a real launch, as a user's would be.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = Path(__file__).resolve().parent / "rank_pool_server.py"
START_S = 180.0  # a pool's start-up (imports), added to the first case's time-out
FAILED_PEER_WAIT_S = 30.0  # after one rank failed, how long the others get to finish before the pool is stopped
# A case that leaves threads behind makes every later one slower: before `release_destroyed_groups`, each case left
# its gloo groups' `gloo_tcp_loop` threads (753 per rank after 37 cases in session 20, load average ~500). A pool
# whose ranks have more threads than this after a case is restarted before the next one.
MAX_THREADS = 64
ENABLED = os.environ.get("SHARDTRAIN_TEST_POOL", "1") != "0"


class RankPool:
    """`nproc` rank processes (torchrun for 2 and more, one plain process for 1) running cases one at a time."""

    def __init__(self, nproc: int, env: dict[str, str]) -> None:
        self.nproc, self.env = nproc, env
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None
        self.case = 0
        self.stopped_because = "first case"

    def _command(self) -> list[str]:
        if self.nproc == 1:
            return [sys.executable, str(SERVER), str(self.dir)]
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.nproc}", str(SERVER),
                str(self.dir)]

    def _start(self) -> None:
        _record_start(self.nproc, self.stopped_because)
        self.dir = Path(tempfile.mkdtemp(prefix=f"shardtrain-rank-pool-{self.nproc}-"))
        with open(self.dir / "pool.log", "wb") as log:
            self.proc = subprocess.Popen(self._command(), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.case = 0

    def stop(self, because: str = "stopped") -> None:
        """End the pool: ask its ranks to leave, and kill what is left (`because`: what its next start records)."""
        self.stopped_because = because
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._write_job({"stop": True})
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._kill()
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.proc, self.dir = None, None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _write_job(self, job: dict) -> None:
        path = self.dir / f"job-{self.case}.json"
        path.with_suffix(".tmp").write_text(json.dumps(job))
        path.with_suffix(".tmp").rename(path)

    def _outputs(self, case: int) -> tuple[str, str]:
        def read(suffix: str) -> str:
            return "".join((self.dir / f"{case}-{rank}.{suffix}").read_text(errors="replace")
                           for rank in range(self.nproc) if (self.dir / f"{case}-{rank}.{suffix}").exists())

        return read("out"), read("err")

    def run(self, script: str | Path, args: list[str], *, env: dict[str, str], timeout: float,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Run `script args` on every rank of the pool (in `cwd`, else the pool's folder); what a launch of it would
        have returned."""
        starting = self.proc is None or self.proc.poll() is not None
        if starting:
            if self.proc is not None:
                self.stop(because="its processes ended by themselves")
            self._start()
        case = self.case
        self._write_job({"script": str(script), "args": [str(a) for a in args], "env": env,
                         "cwd": str(cwd) if cwd is not None else None})
        deadline = time.monotonic() + timeout + (START_S if starting else 0.0)
        failed_since = None
        while True:
            codes = [self._code(case, rank) for rank in range(self.nproc)]
            if all(code is not None for code in codes):
                break
            if failed_since is None and any(code not in (None, 0) for code in codes):
                failed_since = time.monotonic()
            if self.proc.poll() is not None or (failed_since and time.monotonic() - failed_since > FAILED_PEER_WAIT_S):
                break
            if time.monotonic() > deadline:
                out, err = self._outputs(case)
                self.stop(because=f"time-out: {script}")
                raise subprocess.TimeoutExpired(f"rank pool case {script}", timeout, out, err)
            time.sleep(0.02)
        out, err = self._outputs(case)
        failed = [code for code in codes if code not in (None, 0)]
        if failed or None in codes:
            pool_log = (self.dir / "pool.log").read_text(errors="replace")
            err += f"\n[rank pool: exit codes {codes}; the pool's own log ends:]\n{pool_log[-4000:]}"
            self.stop(because=f"case failed: {script}")
            return subprocess.CompletedProcess(["rank-pool", str(script), *args], failed[0] if failed else 1,
                                               out, err)
        self.case += 1
        threads = max(self._done(case, rank).get("threads", 0) for rank in range(self.nproc))
        if threads > MAX_THREADS:
            self.stop(because=f"{threads} threads after {script}")
        return subprocess.CompletedProcess(["rank-pool", str(script), *args], 0, out, err)

    def _done(self, case: int, rank: int) -> dict:
        path = self.dir / f"done-{case}-{rank}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _code(self, case: int, rank: int) -> int | None:
        return self._done(case, rank).get("rc")


def _record_start(nproc: int, why: str) -> None:
    """A pool (re)start costs every rank's imports again: SHARDTRAIN_TEST_TIMES's file says when and why."""
    if times := os.environ.get("SHARDTRAIN_TEST_TIMES"):
        with open(times, "a") as out:
            out.write(f"pool-start\t0\t0\t{nproc} ranks: {why}\t{os.environ.get('PYTEST_CURRENT_TEST', '-')}\t"
                      f"{os.environ.get('PYTEST_XDIST_WORKER', '-')}\t{time.time():.0f}\n")


_pools: dict[int, RankPool] = {}


def pool(nproc: int, env: dict[str, str]) -> RankPool:
    """The session's pool of `nproc` ranks (made on first use; stopped by `stop_all`)."""
    if nproc not in _pools:
        _pools[nproc] = RankPool(nproc, env)
    return _pools[nproc]


def stop_all() -> None:
    for each in _pools.values():
        each.stop()
    _pools.clear()
