"""Context parallelism in the Trainer equals one process: training (dp_shard 2 x cp 2, activation checkpointing on
and off), evaluate() and predict() of a tiny Llama and a tiny Qwen2 (sliding window) on padded variable-length
batches at cp 2 and dp 2 x cp 2, and a sharded checkpoint written at dp 2 x cp 2 resumed on 2 ranks at cp 1."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import assert_same_training, python, run_result, torchrun
from tiny_models import tiny_llama

WORKER = Path(__file__).parent / "workers" / "train_run.py"
SHARDED = {"state_dict_type": "SHARDED_STATE_DICT"}


def _eval_jobs(root: Path, suffix: str, **knobs) -> list[dict]:
    return [{"out": str(root / f"eval_{model}_{suffix}"), "model": model, "eval_only": True, "predict": True, **knobs}
            for model in ("llama", "qwen2")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    python(WORKER, json.dumps([{"out": str(root / "ref"), "per_device_train_batch_size": 8, "weights": True},
                               *_eval_jobs(root, "ref")]))
    torchrun(WORKER, 4, json.dumps([
        {"out": str(root / "dp2cp2"), "per_device_train_batch_size": 4, "cp_size": 2, "weights": True,
         "save_strategy": "steps", "save_steps": 5, "fsdp_config": SHARDED},
        {"out": str(root / "dp2cp2_ac"), "per_device_train_batch_size": 4, "cp_size": 2, "weights": True,
         "fsdp_config": {"activation_checkpointing": True}},
        *_eval_jobs(root, "dp2cp2", cp_size=2)]))
    resumed = root / "resumed_cp1"
    resumed.mkdir()
    shutil.copytree(root / "dp2cp2" / "checkpoint-5", resumed / "checkpoint-5")
    torchrun(WORKER, 2, json.dumps([
        {"out": str(resumed), "per_device_train_batch_size": 4, "resume": True, "fsdp_config": SHARDED},
        *_eval_jobs(root, "cp2", cp_size=2)]))
    return root


@pytest.mark.parametrize("name", ["dp2cp2", "dp2cp2_ac"])
def test_training_on_dp2_cp2_equals_one_process(runs, name):
    assert_same_training(runs, "ref", name)
    ref_weights, initial = torch.load(runs / "ref" / "weights.pt"), tiny_llama().state_dict()
    assert max((ref_weights[k] - initial[k]).abs().max().item() for k in ref_weights) > 1e-3  # training moved them


@pytest.mark.parametrize("layout", ["cp2", "dp2cp2"])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_evaluate_and_predict_under_cp_equal_one_process(runs, model, layout):
    ref, got = run_result(runs, f"eval_{model}_ref"), run_result(runs, f"eval_{model}_{layout}")
    assert set(got["eval_metrics"]) == set(ref["eval_metrics"]) >= {"eval_loss", "eval_accuracy", "eval_logit_sum"}
    assert got["eval_metrics"]["eval_loss"] == pytest.approx(ref["eval_metrics"]["eval_loss"], abs=1e-5)
    assert got["eval_metrics"]["eval_accuracy"] == pytest.approx(ref["eval_metrics"]["eval_accuracy"], abs=1e-9)
    assert got["eval_metrics"]["eval_logit_sum"] == pytest.approx(ref["eval_metrics"]["eval_logit_sum"], rel=1e-7)
    ref_pred = torch.load(runs / f"eval_{model}_ref" / "predict.pt")
    got_pred = torch.load(runs / f"eval_{model}_{layout}" / "predict.pt")
    assert got_pred["predictions"].shape == ref_pred["predictions"].shape  # full length, all 20 samples
    assert ref_pred["predictions"].shape[:2] == (20, 15)  # 20 samples, the longest has 15 tokens
    assert torch.equal(got_pred["label_ids"], ref_pred["label_ids"])  # same order
    assert (got_pred["predictions"] - ref_pred["predictions"]).abs().max().item() < 1e-5
    assert got_pred["metrics"]["test_loss"] == pytest.approx(ref_pred["metrics"]["test_loss"], abs=1e-5)


def test_sharded_checkpoint_from_dp2_cp2_resumes_on_two_ranks_without_cp(runs):
    uninterrupted, resumed = run_result(runs, "dp2cp2"), run_result(runs, "resumed_cp1")
    assert resumed["steps"] == list(range(1, 11))  # steps 1-5 from the checkpoint's log history, 6-10 run here
    assert resumed["losses"][5:] == pytest.approx(uninterrupted["losses"][5:], abs=1e-6, rel=0)
    assert resumed["losses"][:5] == uninterrupted["losses"][:5]
