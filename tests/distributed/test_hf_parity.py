"""transformers' EarlyStoppingCallback stops a shardtrain run at the step where it stops Hugging Face's, with the
same losses; the run trains a `datasets.Dataset` with text, label and idx columns through the default
collator (remove_unused_columns drops text and idx, `label` becomes `labels`). With save_total_limit=1 and
load_best_model_at_end, the same checkpoints are left after every save and at the end."""

import json
from pathlib import Path

import pytest
from launch import python

WORKER = Path(__file__).parent / "workers" / "hf_parity.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    logs = {which: python(WORKER, which, str(root / which)) for which in ("ours", "hf")}
    return {which: json.loads((root / which / "result.json").read_text()) for which in logs}, logs


def test_early_stopping_stops_at_the_same_step(runs):
    results, _ = runs
    ours, hf = results["ours"], results["hf"]
    assert ours["global_step"] == hf["global_step"] < 40  # stopped early, at the same step
    assert ours["losses"] == pytest.approx(hf["losses"], abs=1e-6)
    assert ours["eval_losses"] == pytest.approx(hf["eval_losses"], abs=1e-6)
    assert ours["best_metric"] == pytest.approx(hf["best_metric"], abs=1e-6)


def test_text_and_idx_columns_are_dropped_with_hugging_faces_message(runs):
    _, logs = runs
    assert "have been ignored: idx, text." in logs["ours"].stdout


def test_save_total_limit_keeps_the_checkpoints_hugging_face_keeps(runs):
    # save_total_limit=1 with load_best_model_at_end: the newest and the best while training, the best at the end
    results, _ = runs
    ours, hf = results["ours"], results["hf"]
    assert ours["checkpoints_during"] == hf["checkpoints_during"]
    assert any(len(left) == 2 for left in hf["checkpoints_during"])  # the best was not the newest at some save
    assert ours["checkpoints"] == hf["checkpoints"] == [hf["best_checkpoint"]]
