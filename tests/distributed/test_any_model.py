"""Models that are not token language models train as under transformers' own Trainer: a regression model
without embeddings on float features, a plain module returning tuples, a ViT on pixel_values, a multi-label
classifier and a siamese model with a custom cosine loss on two float inputs (`workers/any_model.py`).

Losses, eval loss and predictions of shardtrain on one process equal transformers.Trainer's (1e-5); two ranks
equal one process; a resume from checkpoint-2 gives bit-identical weights, dropout included.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from launch import hf_and_ours, read_json

WORKER = Path(__file__).parent / "workers" / "any_model.py"
HF_CASES = ("regression", "tuple", "vit", "multilabel", "siamese")
CASES = (*HF_CASES, "regression_dropout")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return hf_and_ours(WORKER, tmp_path_factory.mktemp("any_model"))


@pytest.mark.parametrize("name", HF_CASES)
def test_one_process_equals_transformers_trainer(runs, name):
    ours, hf = read_json(runs / "ours1" / f"{name}.json"), read_json(runs / "hf" / f"{name}.json")
    assert len(ours["losses"]) == len(hf["losses"]) == 4
    assert ours["losses"] == pytest.approx(hf["losses"], abs=1e-5)
    assert ours["losses"][-1] < ours["losses"][0]  # it learned
    assert ours["training_loss"] == pytest.approx(hf["training_loss"], abs=1e-5)
    assert ours["eval_loss"] == pytest.approx(hf["eval_loss"], abs=1e-5)
    assert ours["test_loss"] == pytest.approx(hf["test_loss"], abs=1e-5)
    np.testing.assert_allclose(np.array(ours["predictions"]), np.array(hf["predictions"]), atol=1e-5)


@pytest.mark.parametrize("name", HF_CASES)
def test_two_ranks_equal_one_process(runs, name):
    one, two = read_json(runs / "ours1" / f"{name}.json"), read_json(runs / "ours2" / f"{name}.json")
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-5)
    np.testing.assert_allclose(np.array(two["predictions"]), np.array(one["predictions"]), atol=1e-5)
    a = torch.load(runs / "ours1" / f"{name}.pt", weights_only=True)
    b = torch.load(runs / "ours2" / f"{name}.pt", weights_only=True)
    assert a.keys() == b.keys()
    # AdamW turns rounding-level gradient differences of near-zero gradients into lr-sized steps
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-3


@pytest.mark.parametrize("run", ["ours1", "ours2"])
@pytest.mark.parametrize("name", CASES)
def test_resume_is_bit_identical(runs, run, name):
    result = read_json(runs / run / f"{name}.json")
    assert result["changed"] > 1e-2  # training moved the weights
    assert result["resume_identical"]
