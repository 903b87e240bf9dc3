"""A stopped peer becomes an error within ddp_timeout; SIGINT/SIGTERM end `shardtrain launch` with 130/143, one
line, and no orphaned worker."""

import signal
import subprocess
import time

import psutil
import pytest
from conftest import SCRIPTS, cli_cmd, cli_env, explain

SCRIPT = SCRIPTS / "stall.py"


def _start(home, out, mode) -> subprocess.Popen:
    return subprocess.Popen(cli_cmd("launch", "--cpu", "--num_processes", 2, SCRIPT, out, mode),
                            env=cli_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_stopped_rank_is_an_error_within_ddp_timeout(tmp_path):
    proc = _start(tmp_path / "home", tmp_path / "out", "sigstop")
    stdout, stderr = proc.communicate(timeout=240)  # ddp_timeout is 10 s; the default would be 1800 s
    assert proc.returncode == 1, explain(proc, stdout, stderr)
    assert "exit codes by global rank" in stderr, explain(proc, stdout, stderr)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_ends_launch_with_128_plus_signal_and_no_orphans(tmp_path, sig, code):
    proc = _start(tmp_path / "home", tmp_path / "out", "sleep")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all((tmp_path / "out" / f"ready-{r}").exists() for r in (0, 1)):
        time.sleep(0.5)
    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, explain(proc, stdout, stderr)
    assert f"error: stopped by {sig.name}; the workers were terminated" in stderr, explain(proc, stdout, stderr)
    time.sleep(1)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
