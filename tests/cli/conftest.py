"""Helpers for the command-line tests: a private SHARDTRAIN_HOME, `shardtrain` run as a real process.

    /work/main/.venv/bin/python -m pytest tests/cli -x -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from launch import REPO, worker_env  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh SHARDTRAIN_HOME, also set in this process (for in-process `main([...])` calls)."""
    path = tmp_path / "home"
    monkeypatch.setenv("SHARDTRAIN_HOME", str(path))
    return path


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """Worker environment (1 thread, tests on PYTHONPATH) without SHARDTRAIN_CPU: the launcher must set it."""
    env = worker_env(SHARDTRAIN_HOME=str(home), **extra)
    env.pop("SHARDTRAIN_CPU", None)
    return env


def cli_cmd(*args: object) -> list[str]:
    """`python -m shardtrain.cli.main ARGS` with this interpreter."""
    return [sys.executable, "-m", "shardtrain.cli.main", *map(str, args)]


def run_cli(
    *args: object, home: Path, stdin: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Run `shardtrain ARGS` as a process and return it (stdout/stderr captured as text)."""
    return subprocess.run(
        cli_cmd(*args),
        env=cli_env(home),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def explain(proc: subprocess.CompletedProcess | subprocess.Popen, stdout: str = "", stderr: str = "") -> str:
    """Failure message with the ends of both streams."""
    out = stdout or getattr(proc, "stdout", "") or ""
    err = stderr or getattr(proc, "stderr", "") or ""
    return f"exit {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-6000:]}"


def launch_ok(home: Path, *args: object, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """`shardtrain launch ARGS` as a real process (extra environment `env`); fails the test with the ends of both
    streams unless it exits 0."""
    proc = subprocess.run(cli_cmd("launch", *args), env=cli_env(home, **env), capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode == 0, explain(proc)
    return proc


def launch_pooled(home: Path, *args: object, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """`shardtrain launch ARGS` for a test whose subject is what the launcher hands the script (flags, a config
    file, parallelism), not the launch itself: the launcher decides, in its own `--dry_run` (torchrun's arguments,
    the variables it sets and unsets), and the script runs with exactly those on the session's rank pool. Tests of
    the launch itself (exit codes, restarts, signals, machines) use `launch_ok`."""
    from launch import torchrun

    dry = subprocess.run(cli_cmd("launch", "--dry_run", *args), env=cli_env(home, **env), capture_output=True,
                         text=True, timeout=120, cwd=cwd)
    assert dry.returncode == 0, explain(dry)
    plan = json.loads(dry.stdout)
    argv = plan["torchrun_argv"]
    nproc = int(next(arg.split("=", 1)[1] for arg in argv if arg.startswith("--nproc_per_node=")))
    at = next(i for i, arg in enumerate(argv) if not arg.startswith("--"))  # the script, then its arguments
    run_env = {**cli_env(home, **env), **plan["env"]}
    for name in plan["unset"]:
        run_env.pop(name, None)
    return torchrun(Path(cwd or REPO) / argv[at], nproc, *argv[at + 1:], env=run_env, cwd=cwd)


def run_together(commands: list[tuple[list[str], dict[str, str]]], timeout: float = 400) -> list[tuple]:
    """Start every (command, environment) at once (the "machines" of a multi-machine launch), wait for all, and fail
    the test with the ends of the streams of any that did not exit 0; returns (proc, stdout, stderr) of each."""
    procs = [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in commands]
    try:
        done = [(proc, *proc.communicate(timeout=timeout)) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, stdout, stderr in done:
        assert proc.returncode == 0, explain(proc, stdout, stderr)
    return done
