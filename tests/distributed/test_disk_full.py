"""A full disk during a save: one clear error on every rank, the partial checkpoint removed, the previous one
intact and loadable. The disk is a small tmpfs (the tests run as root, as CI does)."""

import json
import subprocess
from pathlib import Path

import pytest
from launch import torchrun

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.checkpoint.manifest import manifest_problem

WORKER = Path(__file__).parent / "workers" / "train_run.py"
JOB = {"per_device_train_batch_size": 4, "max_steps": 6, "save_strategy": "steps", "save_steps": 2,
       "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}


def _usage(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path, small_disk):
    # measure one checkpoint on the normal disk, then give the run room for about 1.5 of them
    probe = tmp_path / "probe"
    torchrun(WORKER, 2, json.dumps([{**JOB, "out": str(probe), "max_steps": 2}]))
    size = _usage(probe / "checkpoint-2")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(size * 3 // 2) // 4096 * 4096 + 8192}",
                    "tmpfs", str(small_disk)], check=True)
    out = small_disk / "run"
    proc = torchrun(WORKER, 2, json.dumps([{**JOB, "out": str(out)}]), check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert any(f"no space left on device in {out} while saving checkpoint-4" in line for line in errors), \
        proc.stderr[-3000:]
    print("\n".join(errors))
    assert len(errors) == 1, errors  # rank 0 reports it; rank 1 raised the same error silently
    assert [p.name for p in CheckpointManager.list_checkpoints(out)] == ["checkpoint-2"]
    assert manifest_problem(out / "checkpoint-2") is None
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]
