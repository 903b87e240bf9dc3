"""Hugging Face's override points, overridden with Hugging Face's signatures in a subclass, are called as often
under shardtrain's Trainer as under transformers' (`workers/overrides.py` counts them on both), and a
`compute_loss` override shapes training and evaluation losses alike. Both classes are the transformers ones
(`isinstance`), the callback handler holds Hugging Face's default callbacks, and predicting on data without
labels (run_glue.py's --do_predict) returns predictions without calling compute_metrics."""

from pathlib import Path

import numpy as np
import pytest
from launch import ours_and_hf_json

WORKER = Path(__file__).parent / "workers" / "overrides.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ours_and_hf_json(WORKER, tmp_path_factory.mktemp("overrides"))


def test_each_override_is_called_as_often_as_under_transformers(runs):
    ours, hf = runs
    assert ours["counts"] == hf["counts"]
    assert set(hf["counts"]) == {"compute_loss", "training_step", "prediction_step", "create_optimizer",
                                 "create_scheduler", "get_decay_parameter_names", "log", "get_train_dataloader",
                                 "get_eval_dataloader", "get_test_dataloader", "evaluation_loop"}
    assert ours["counts"]["get_train_dataloader"] == 1  # once per train(), and its batches were trained on
    assert ours["counts"]["get_eval_dataloader"] == 2 and ours["counts"]["evaluation_loop"] == 3  # 2 evals + predict
    assert ours["counts"]["training_step"] == 4 and ours["counts"]["prediction_step"] == 6  # 2 evals + predict


def test_a_compute_loss_override_shapes_training_and_evaluation_alike(runs):
    ours, hf = runs
    assert ours["losses"] == pytest.approx(hf["losses"], abs=1e-5)
    assert ours["eval_losses"] == pytest.approx(hf["eval_losses"], abs=1e-5) and len(ours["eval_losses"]) == 2


def test_the_classes_and_callbacks_are_hugging_faces(runs):
    ours, hf = runs
    assert ours["is_trainer"] and ours["is_arguments"] and ours["has_flow"]
    assert ours["callbacks"] == ["DefaultFlowCallback", "PrinterCallback"]  # Hugging Face's own (disable_tqdm)
    assert ours["callbacks_after_remove"] == hf["callbacks_after_remove"] == ["DefaultFlowCallback"]
    assert ours["trainable"] == hf["trainable"] > 0
    assert ours["output_dir"].endswith("ours.json.dir")  # TrainingArguments("out") took the positional path


def test_predicting_unlabeled_data_skips_metrics(runs):
    ours, hf = runs
    assert ours["label_ids"] is None and hf["label_ids"] is None
    assert not any("accuracy" in m for m in ours["predict_metrics"])
    np.testing.assert_allclose(np.array(ours["predictions"]), np.array(hf["predictions"]), atol=1e-5)
