"""A rank SIGKILLed in the middle of a save leaves the previous checkpoint usable and nothing that looks complete."""

import json
from pathlib import Path

import pytest
from launch import python, torchrun, worker_env

from shardtrain.checkpoint.manager import CheckpointManager

WORKER = Path(__file__).parent / "workers" / "train_run.py"
# (fault point, rank killed, state dict type)
FAULTS = [("save_start", 1, "SHARDED_STATE_DICT"), ("after_model", 1, "FULL_STATE_DICT"),
          ("before_commit", 0, "SHARDED_STATE_DICT")]


@pytest.mark.parametrize("point,rank,kind", FAULTS)
def test_killed_save_keeps_previous_checkpoint(tmp_path, point, rank, kind):
    out = tmp_path / "run"
    knobs = {"out": str(out), "per_device_train_batch_size": 4, "max_steps": 8, "save_strategy": "steps",
             "save_steps": 3, "save_total_limit": 1, "fsdp_config": {"state_dict_type": kind}}
    # checkpoint-3 is written; the save of step 6 is killed on one rank at `point`
    crashed = torchrun(WORKER, 2, json.dumps([knobs]), env=worker_env(SHARDTRAIN_FAULT=f"{point}:{rank}:6"),
                       check=False)
    assert crashed.returncode != 0
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-3" in names and "checkpoint-6" not in names, names
    assert [p.name for p in CheckpointManager.list_checkpoints(out)] == ["checkpoint-3"]
    # the survivor resumes (here on one process) and finishes the run
    python(WORKER, json.dumps([{**knobs, "per_device_train_batch_size": 8, "resume": True}]))
    result = json.loads((out / "result.json").read_text())
    assert result["global_step"] == 8 and result["steps"][-1] == 8
    assert [p.name for p in CheckpointManager.list_checkpoints(out)] == ["checkpoint-8"]  # the last step; limit 1
