"""save_async=True: the same checkpoints, weights and resumes as synchronous saves; errors agreed; commit atomic."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import torchrun, worker_env
from safetensors.torch import load_file

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.checkpoint.manifest import manifest_problem
from shardtrain.checkpoint.safe_load import read_dcp_metadata

WORKER = Path(__file__).parent / "workers" / "train_run.py"
TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
MODES = ("sync", "async")
# Background writes start 0.5 s late, so several training steps run while a save is pending: a checkpoint that
# was not staged (copied) before training continued would hold the weights of a later step.
DELAY = {"checkpoint_fault": {"delay_s": 0.5}}


def _knobs(root: Path, kind: str, mode: str) -> dict:
    return {"out": str(root / f"{kind}-{mode}"), "per_device_train_batch_size": 4, "max_steps": 6,
            "save_strategy": "steps", "save_steps": 2, "fsdp_config": {"state_dict_type": kind},
            **({"save_async": True, **DELAY} if mode == "async" else {})}


def _result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


def _files(path: Path) -> dict[str, Path]:
    return {p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    jobs = []
    for kind in TYPES:
        for mode in MODES:
            jobs.append({**_knobs(root, kind, mode), "save_model": str(root / f"{kind}-{mode}-final")})
    for kind in TYPES:  # a new Trainer resumes from checkpoint-4 of each run (jobs run in order)
        for mode in MODES:
            jobs.append({**_knobs(root, kind, mode), "out": str(root / f"{kind}-{mode}-resumed"),
                         "resume": str(root / f"{kind}-{mode}" / "checkpoint-4")})
    torchrun(WORKER, 2, json.dumps(jobs))
    return root


@pytest.mark.parametrize("kind", TYPES)
def test_async_training_and_final_weights_equal_sync(runs, kind):
    sync, done = _result(runs / f"{kind}-sync"), _result(runs / f"{kind}-async")
    assert done["steps"] == [1, 2, 3, 4, 5, 6]
    assert done["losses"] == sync["losses"] and done["eval_loss"] == sync["eval_loss"]
    a, b = (load_file(runs / f"{kind}-{mode}-final" / "model.safetensors") for mode in MODES)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


MEASURED = ("tokens_per_second", "peak_memory_mb", "peak_memory_mb_per_rank")


@pytest.mark.parametrize("kind", TYPES)
def test_async_checkpoints_hold_the_same_files_and_bytes(runs, kind):
    for mode in MODES:
        names = sorted(p.name for p in (runs / f"{kind}-{mode}").iterdir())
        # no .tmp- directory left, and every checkpoint matches its manifest
        assert names == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "metrics.jsonl", "report.png",
                         "result.json"], names
        assert all(manifest_problem(runs / f"{kind}-{mode}" / f"checkpoint-{s}") is None for s in (2, 4, 6))
    for step in (2, 4, 6):
        sync, done = (_files(runs / f"{kind}-{mode}" / f"checkpoint-{step}") for mode in MODES)
        assert sync.keys() == done.keys()
        for name in sync:
            if name.endswith(".metadata"):  # DCP's metadata records the checkpoint path; compare the rest
                meta = [read_dcp_metadata(files[name].parent) for files in (sync, done)]
                assert meta[0].state_dict_metadata == meta[1].state_dict_metadata
                assert meta[0].storage_data == meta[1].storage_data
            elif name == "trainer_state.json":  # equal but for the measured speed and memory in the logs
                states = [json.loads(files[name].read_text()) for files in (sync, done)]
                for state in states:
                    for entry in state["log_history"]:
                        for key in MEASURED:
                            entry.pop(key, None)
                assert states[0] == states[1], f"checkpoint-{step}/{name} differs"
            elif name.endswith(".safetensors"):
                # FULL_STATE_DICT's model: every rank writes its part when saving synchronously (torch's safetensors
                # consolidation), rank 0 writes it in the background (safetensors' writer); the headers differ
                a, b = (load_file(files[name]) for files in (sync, done))
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
                                                    for k in a), f"checkpoint-{step}/{name} differs"
            elif name != "manifest.json":  # its checksums cover .metadata and trainer_state.json
                assert sync[name].read_bytes() == done[name].read_bytes(), f"checkpoint-{step}/{name} differs"


@pytest.mark.parametrize("kind", TYPES)
def test_resume_from_async_checkpoint_equals_resume_from_sync(runs, kind):
    ref = _result(runs / f"{kind}-sync")
    for mode in MODES:
        got = _result(runs / f"{kind}-{mode}-resumed")
        assert got["steps"] == [1, 2, 3, 4, 5, 6]
        assert got["losses"][4:] == ref["losses"][4:]  # steps 5-6, bit-identical
        assert got["grad_norms"][4:] == ref["grad_norms"][4:]


def test_background_error_is_raised_on_every_rank_and_leaves_no_checkpoint(tmp_path):
    out = tmp_path / "run"
    knobs = {**_knobs(tmp_path, "FULL_STATE_DICT", "async"), "out": str(out),
             "checkpoint_fault": {"fail_step": 4}}
    # rank 0's model.safetensors of step 4 fails in the background; every rank raises at the save of step 6
    failed = torchrun(WORKER, 2, json.dumps([knobs]), check=False, timeout=300)
    assert failed.returncode != 0
    assert "error: no space left on device" in failed.stderr and "checkpoint-4" in failed.stderr, failed.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]  # no .tmp- left


def test_crash_before_commit_leaves_only_the_tmp_directory(tmp_path):
    out = tmp_path / "run"
    knobs = {**_knobs(tmp_path, "SHARDED_STATE_DICT", "async"), "out": str(out)}
    # rank 0 is SIGKILLed in the background thread after every rank wrote checkpoint-4, before the rename
    crashed = torchrun(WORKER, 2, json.dumps([knobs]), env=worker_env(SHARDTRAIN_FAULT="before_commit:0:4"),
                       check=False, timeout=300)
    assert crashed.returncode != 0
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-2" in names and ".tmp-checkpoint-4" in names and "checkpoint-4" not in names, names
    assert [p.name for p in CheckpointManager.list_checkpoints(out)] == ["checkpoint-2"]
    shutil.rmtree(out)
