"""Multi-process runs for tests: torchrun (`torch.distributed.run`) on a port it picks, gloo, 1 thread.

A run expected to succeed goes to the session's rank pool (`rank_pool.py`: ranks started once, each case run in
them as a launch would run it; SHARDTRAIN_TEST_POOL=0 turns it off); a run expected to fail (`check=False`), or
one whose launch is under test (`pooled=False`), always starts real processes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import rank_pool

REPO = Path(__file__).resolve().parents[1]


def benchmark_module(name: str) -> Any:
    """`benchmarks/<name>.py` loaded as a module (the benchmarks are scripts, not a package of the suite)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SHARDTRAIN_CPU="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO / "tests") + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _pooled(nproc: int, script: str | Path, args: tuple, timeout: float, env: dict | None, pooled: bool | None,
            check: bool, cwd: Path | None = None) -> subprocess.CompletedProcess | None:
    if not (rank_pool.ENABLED and (check if pooled is None else pooled)):
        return None
    proc = rank_pool.pool(nproc, worker_env()).run(script, list(args), env=env or worker_env(), timeout=timeout,
                                                   cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} on {nproc} pooled rank(s) failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600, env: dict | None = None,
             check: bool = True, pooled: bool | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks (pooled: by default when `check`) or with torchrun on a fresh port, in `cwd`;
    fail with its output on error."""
    done = _pooled(nproc, script, args, timeout, env, pooled, check, cwd)
    if done is not None:
        return done
    # No port given: torchrun's c10d rendezvous binds port 0 itself (a port picked beforehand could be taken
    # by another test before torchrun binds it).
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", str(script), *args]
    proc = subprocess.run(cmd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


def shardtrain_launch(script: str | Path, nproc: int, *args: str, flags: tuple[str, ...] = (), timeout: float = 600,
                      env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`shardtrain launch --cpu --num_processes N FLAGS script ARGS` as a user runs it (always real processes)."""
    cmd = [sys.executable, "-m", "shardtrain.cli.main", "launch", "--cpu", "--num_processes", str(nproc), *flags,
           str(script), *args]
    return subprocess.run(cmd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          stdin=subprocess.DEVNULL)  # not a terminal, whatever runs the tests (trackers would ask)


def error_lines(stderr: str) -> list[str]:
    """The `error:` lines of a run's stderr, without torchrun's `[rankN]: ` prefix."""
    lines = [line.split("]: ", 1)[-1] if line.startswith("[rank") else line for line in stderr.splitlines()]
    return [line for line in lines if line.startswith("error")]


def python(script: str | Path, *args: str, timeout: float = 600, env: dict | None = None,
           check: bool = True, pooled: bool | None = None) -> subprocess.CompletedProcess:
    """Run `script` as one plain process (no launcher; pooled by default when `check`)."""
    done = _pooled(1, script, args, timeout, env, pooled, check)
    if done is not None:
        return done
    proc = subprocess.run([sys.executable, str(script), *args], env=env or worker_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def hf_and_ours(script: str | Path, root: Path) -> Path:
    """Run a worker that takes `hf|ours OUT` three ways: transformers' Trainer (root/hf), shardtrain's on one
    process (root/ours1) and on two ranks (root/ours2); returns root."""
    python(script, "hf", str(root / "hf"))
    python(script, "ours", str(root / "ours1"))
    torchrun(script, 2, "ours", str(root / "ours2"))
    return root


def ours_and_hf_json(script: str | Path, root: Path) -> tuple[dict, dict]:
    """Run a worker that takes `ours|hf OUT.json` once each as one process; returns (ours, hf) as read back."""
    for which in ("ours", "hf"):
        python(script, which, str(Path(root) / f"{which}.json"))
    return read_json(Path(root) / "ours.json"), read_json(Path(root) / "hf.json")


def reference_and_two_ranks(script: str | Path, root: Path, reference: str) -> Path:
    """Run a worker that takes `MODE OUT` as the library's own trainer on one process (MODE `reference`, into
    root/reference) and as shardtrain's on two ranks ("ours", into root/ours); returns root."""
    python(script, reference, str(root / reference))
    torchrun(script, 2, "ours", str(root / "ours"))
    return root


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def run_result(root: Path, name: str) -> dict:
    """What `workers/train_run.py` wrote for the job whose "out" was root/name."""
    return read_json(Path(root) / name / "result.json")


def assert_same_training(root: Path, reference: str, name: str, tol: float = 1e-5,
                         weight_tol: float | None = None) -> None:
    """Job `name` trained like job `reference` (train_run.py results): the same steps, losses, gradient norms,
    eval loss and (both run with "weights") final weights within `tol`; and the reference really learned."""
    import pytest
    import torch

    ref, got = run_result(root, reference), run_result(root, name)
    assert got["steps"] == ref["steps"] == list(range(1, 11))
    assert got["losses"] == pytest.approx(ref["losses"], abs=tol, rel=0)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], abs=tol, rel=0)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=tol)
    assert len(set(ref["losses"])) == 10  # the model learns: losses are not a constant
    ref_weights = torch.load(Path(root) / reference / "weights.pt")
    got_weights = torch.load(Path(root) / name / "weights.pt")
    assert got_weights.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        assert (got_weights[key] - value).abs().max().item() < (weight_tol or tol), key


class LogLines(logging.Handler):
    """Keeps what a logger emits (INFO and up), for workers that report what a code path said: the messages,
    and the `read_stats` a record carries (the sharded loader's bytes read)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.stats: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if hasattr(record, "read_stats"):
            self.stats.append(record.read_stats)
