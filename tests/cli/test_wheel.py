"""The package as a user installs it: a wheel and an sdist built from this checkout; the wheel with its `report`
extra in a venv of its own, holding torch and what the wheel pulls in, nothing of the dev extra (the demo's
install); `shardtrain --version` says the one version; a 2-rank run of the demo ends with a checkpoint and no
config warning.

The venv is made once and reused ($SHARDTRAIN_WHEEL_VENV, default ~/.cache/shardtrain/venv-wheel): torch is
installed the first time (from pip's cache when warm); every run uninstalls shardtrain and installs the new wheel.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO, worker_env

import shardtrain

VENV = Path(os.environ.get("SHARDTRAIN_WHEEL_VENV", Path.home() / ".cache" / "shardtrain" / "venv-wheel"))
DEV_ONLY = ["trl", "wandb", "mlflow-skinny", "sentence-transformers", "peft", "optuna", "pytest", "mkdocs"]


def _run(*argv, timeout=900, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO)
    python = VENV / "bin" / "python"
    if not python.exists():
        _run("python3", "-m", "venv", VENV)
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0:
        _run(python, "-m", "pip", "install", "-q", "torch==2.13.0")
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "shardtrain"], capture_output=True)
    wheel = next(dist.glob("shardtrain-*.whl"))
    _run(python, "-m", "pip", "install", "-q", f"{wheel}[report]")
    assert {p.name for p in dist.iterdir()} == {wheel.name, f"shardtrain-{shardtrain.__version__}.tar.gz"}
    return VENV


def test_the_wheel_installs_what_the_demo_needs_and_nothing_of_the_dev_extra(installed):
    listed = _run(installed / "bin" / "python", "-m", "pip", "list", "--format", "json").stdout
    names = {entry["name"].lower() for entry in json.loads(listed)}
    assert {"shardtrain", "torch", "transformers", "matplotlib"} <= names
    assert not names & set(DEV_ONLY), names & set(DEV_ONLY)
    version = _run(installed / "bin" / "shardtrain", "--version").stdout.strip()
    assert version == f"shardtrain {shardtrain.__version__}"


def test_the_installed_wheel_runs_the_demo_on_two_ranks(installed, tmp_path):
    out = tmp_path / "demo"
    env = worker_env(SHARDTRAIN_HOME=str(tmp_path / "home"))
    env.pop("PYTHONPATH")  # the installed package only, not this checkout's tests
    proc = _run(installed / "bin" / "shardtrain", "launch", "--cpu", "--num_processes", "2",
                REPO / "examples" / "train_demo.py", "--max_steps", "5", "--output_dir", out, env=env, cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == 5 and Path(summary["checkpoint"]).name == "checkpoint-5"
    assert "no config file found" not in proc.stderr
    assert str(installed) in _run(installed / "bin" / "python", "-c", "import shardtrain; print(shardtrain.__file__)",
                                  cwd=tmp_path).stdout
