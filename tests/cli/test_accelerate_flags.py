"""Accelerate's launch habits: `accelerate launch` with FSDP flags and `shardtrain launch` with Accelerate's flag
names run a shardtrain script exactly as they say (bf16, offloaded, checkpointed: read back from the sharded
model), or stop before training with the flag named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, cli_cmd, cli_env, explain

SCRIPT = SCRIPTS / "launch_settings.py"
FLAGS = ["--use_fsdp", "--fsdp_version", "2", "--mixed_precision", "bf16", "--fsdp_offload_params", "true",
         "--fsdp_activation_checkpointing", "true"]


def accelerate(*args: object) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", *map(str, args)]


def run(launcher: str, processes: int, flags: list[str], out: Path, home: Path) -> subprocess.CompletedProcess:
    """`accelerate launch` or `shardtrain launch` of the settings script on `processes` CPU ranks."""
    if launcher == "accelerate":
        cmd = accelerate("--num_processes", processes, "--num_machines", 1, "--dynamo_backend", "no", *flags,
                         SCRIPT, out)
    else:
        cmd = cli_cmd("launch", "--num_processes", processes, "--cpu", *flags, SCRIPT, out)
    return subprocess.run(cmd, env=cli_env(home, SHARDTRAIN_CPU="1"), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("launcher", ["accelerate", "shardtrain"])
def test_fsdp_flags_are_honoured(launcher, home, tmp_path):
    proc = run(launcher, 2, FLAGS, tmp_path, home)
    assert proc.returncode == 0, explain(proc)
    got = json.loads((tmp_path / "settings.json").read_text())
    assert got["world_size"] == 2 and got["fsdp_enabled"] and got["bf16"]
    assert got["cpu_offload"] and got["offloaded"]  # every FSDP unit has the CPU offload policy
    assert got["param_dtypes"] == ["torch.bfloat16"]  # FSDP2's mixed precision: bf16 compute
    assert got["activation_checkpointing"] and got["checkpointed_layers"] == 2
    assert got["finite"]


@pytest.mark.parametrize(("launcher", "flags", "named"), [
    ("accelerate", ["--use_fsdp"], "--fsdp_version = 1"),  # Accelerate's default FSDP is version 1
    ("accelerate", ["--dynamo_backend", "inductor"], "torch_compile=True"),
    ("shardtrain", ["--fsdp_version", "1"], "--fsdp_version = 1"),
    ("shardtrain", ["--fsdp_activation_checkpointing_offload", "true"], "--fsdp_activation_checkpointing_offload"),
])
def test_unsupported_flags_stop_before_training(launcher, flags, named, home, tmp_path):
    proc = run(launcher, 1, flags, tmp_path, home)
    assert proc.returncode != 0
    assert named in proc.stderr, explain(proc)
    assert not (tmp_path / "settings.json").exists() and not (tmp_path / "run").exists()
