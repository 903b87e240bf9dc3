"""Start real multi-process runs for tests: torchrun (`torch.distributed.run`) on a port it picks, gloo, 1 thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SHARDTRAIN_CPU="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO / "tests") + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks with torchrun on a fresh port; fail with its output on error."""
    # No port given: torchrun's c10d rendezvous binds port 0 itself (a port picked beforehand could be taken
    # by another test before torchrun binds it).
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", str(script), *args]
    proc = subprocess.run(cmd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


def python(script: str | Path, *args: str, timeout: float = 600, env: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run `script` as one plain process (no launcher)."""
    proc = subprocess.run([sys.executable, str(script), *args], env=env or worker_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
