"""A full disk during a save: one clear error on every rank, the partial checkpoint removed, the previous one
intact and loadable. The disk is a small tmpfs (the tests run as root, as CI does)."""

import json
import subprocess
from pathlib import Path

import pytest
from launch import error_lines, shardtrain_launch, torchrun

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.checkpoint.manifest import manifest_problem

WORKER = Path(__file__).parent / "workers" / "train_run.py"
JOB = {"per_device_train_batch_size": 4, "max_steps": 6, "save_strategy": "steps", "save_steps": 2}


def _usage(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


# one process without FSDP writes Hugging Face's layout (optimizer.pt by torch.save, whose failed write says
# "unexpected pos" and loses the errno); its vocabulary makes that file ~13 MB, so a write fails mid-file
LAYOUTS = {"SHARDED_STATE_DICT": (2, {"fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}),
           "FULL_STATE_DICT": (2, {"fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}}),
           "one_process_hf_layout": (1, {"fsdp": "", "vocab": 50000})}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path, small_disk, layout):
    # measure one checkpoint on the normal disk, then give the run room for about 1.5 of them
    ranks, extra = LAYOUTS[layout]
    job = {**JOB, **extra}
    probe = tmp_path / "probe"
    torchrun(WORKER, ranks, json.dumps([{**job, "out": str(probe), "max_steps": 2}]))
    size = _usage(probe / "checkpoint-2")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(size * 3 // 2) // 4096 * 4096 + 8192}",
                    "tmpfs", str(small_disk)], check=True)
    out = small_disk / "run"
    proc = shardtrain_launch(WORKER, ranks, json.dumps([{**job, "out": str(out)}]),
                             flags=("--fsdp", "false") if "fsdp" in extra else ())
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert any(f"no space left on device in {out} while saving checkpoint-4" in line for line in errors), \
        proc.stderr[-3000:]
    print("\n".join(errors))
    assert len(errors) == 1, errors  # rank 0 reports it; rank 1 raised it silently; launch adds no line
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in CheckpointManager.list_checkpoints(out)] == ["checkpoint-2"]
    assert manifest_problem(out / "checkpoint-2") is None
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]
