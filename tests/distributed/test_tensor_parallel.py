"""Tensor parallelism (the model's own plan) with FSDP2: tp 2 x dp_shard 2 on 4 ranks equals one process (losses,
gradient norms, weights, greedy generation), with activation checkpointing too; its sharded checkpoint resumes
bit-identically on the same layout and on 2 ranks without tp (1e-6). With selective checkpointing (`tp2_sac`)
its per-op policy sees DTensor ops."""

import json
from pathlib import Path

import pytest
from launch import assert_same_training, python, run_result, torchrun

WORKER = Path(__file__).parent / "workers" / "train_run.py"
SHARDED = {"state_dict_type": "SHARDED_STATE_DICT"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    python(WORKER, json.dumps([{"out": str(root / "ref"), "per_device_train_batch_size": 8, "weights": True,
                                "generate": True}]))
    checkpoint = str(root / "tp2" / "checkpoint-5")
    torchrun(WORKER, 4, json.dumps([
        {"out": str(root / "tp2"), "per_device_train_batch_size": 4, "tp_size": 2, "weights": True,
         "generate": True, "save_strategy": "steps", "save_steps": 5, "fsdp_config": SHARDED},
        {"out": str(root / "tp2_ac"), "per_device_train_batch_size": 4, "tp_size": 2, "weights": True,
         "fsdp_config": {"activation_checkpointing": True}},
        {"out": str(root / "tp2_sac"), "per_device_train_batch_size": 4, "tp_size": 2, "weights": True,
         "fsdp_config": {"activation_checkpointing": "selective"}},
        {"out": str(root / "tp2_resumed"), "per_device_train_batch_size": 4, "tp_size": 2, "resume": checkpoint,
         "fsdp_config": SHARDED}]))
    torchrun(WORKER, 2, json.dumps([{"out": str(root / "dp2_resumed"), "per_device_train_batch_size": 4,
                                     "resume": checkpoint, "fsdp_config": SHARDED}]))
    return root


@pytest.mark.parametrize("name", ["tp2", "tp2_ac", "tp2_sac"])
def test_tp2_dp2_equals_one_process(runs, name):
    assert_same_training(runs, "ref", name)


def test_greedy_generation_under_tp_equals_one_process(runs):
    ref, got = run_result(runs, "ref"), run_result(runs, "tp2")
    assert len(ref["generated"]) == 12 and got["generated"] == ref["generated"]


def test_tp_checkpoint_resumes_exactly_and_without_tp(runs):
    tp2 = run_result(runs, "tp2")
    assert run_result(runs, "tp2_resumed")["losses"][5:] == tp2["losses"][5:]  # bit-identical
    assert run_result(runs, "dp2_resumed")["losses"][5:] == pytest.approx(tp2["losses"][5:], abs=1e-6, rel=0)
