"""`Trainer.hyperparameter_search` (Hugging Face's optuna backend) with a `model_init`: on one process and on two
ranks, shardtrain's Trainer runs the trials transformers' Trainer runs (same sampled parameters, same pruned
trials, objectives within 1e-5, a fresh model per trial, checkpoints under `run-<trial>`), and on two ranks every
rank leaves a trial rank 0's study prunes at the same step (`workers/hp_search.py`)."""

from pathlib import Path

import pytest
from launch import hf_and_ours, read_json

WORKER = Path(__file__).parent / "workers" / "hp_search.py"



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = hf_and_ours(WORKER, tmp_path_factory.mktemp("hp_search"))
    return {name: read_json(root / name / "result-0.json") for name in ("hf", "ours1", "ours2")} | \
        {"ours2_rank1": read_json(root / "ours2" / "result-1.json")}


@pytest.mark.parametrize("name", ["ours1", "ours2"])
def test_the_search_runs_the_trials_of_transformers(runs, name):
    hf, ours = runs["hf"], runs[name]
    states = [t["state"] for t in hf["trials"]]
    assert "PRUNED" in states and "COMPLETE" in states  # both ends of a trial were exercised
    assert [t["state"] for t in ours["trials"]] == states
    assert [t["params"] for t in ours["trials"]] == [t["params"] for t in hf["trials"]]
    for mine, theirs in zip(ours["trials"], hf["trials"], strict=True):
        assert mine["intermediate"].keys() == theirs["intermediate"].keys()
        assert list(mine["intermediate"].values()) == pytest.approx(list(theirs["intermediate"].values()), abs=1e-5)
    assert ours["best"][0] == hf["best"][0] and ours["best"][2] == hf["best"][2]
    assert ours["best"][1] == pytest.approx(hf["best"][1], abs=1e-5)
    assert ours["objectives"] == pytest.approx(hf["objectives"], abs=1e-5)


@pytest.mark.parametrize("name", ["ours1", "ours2"])
def test_each_trial_gets_a_fresh_model_and_its_own_run_directory(runs, name):
    hf, ours = runs["hf"], runs[name]
    assert len(ours["inits"]) == len(hf["inits"]) == 1 + len(hf["trials"])  # __init__, then one per train()
    assert ours["checkpoints"] == hf["checkpoints"] == ["run-0/checkpoint-4", "run-0/checkpoint-7"]


def test_every_rank_leaves_a_pruned_trial_with_rank_0(runs):
    rank0, rank1 = runs["ours2"], runs["ours2_rank1"]
    assert rank1["objectives"] == pytest.approx(rank0["objectives"], abs=1e-7)
    assert len(rank1["inits"]) == len(rank0["inits"])
