"""Hugging Face fields that change what is trained do what they do under transformers' Trainer
(`workers/hf_fields.py`): label_smoothing_factor on a classifier and a causal LM, optim "sgd" and "rmsprop"
give transformers' losses on one process (1e-5) and the same on two ranks; neftune_noise_alpha adds noise
while training only (its hook is gone afterwards)."""

from pathlib import Path

import pytest
from launch import hf_and_ours, read_json

WORKER = Path(__file__).parent / "workers" / "hf_fields.py"
HF_CASES = ("smooth_cls", "smooth_lm", "sgd", "rmsprop")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return hf_and_ours(WORKER, tmp_path_factory.mktemp("hf_fields"))


@pytest.mark.parametrize("name", HF_CASES)
def test_equal_to_transformers_and_on_two_ranks(runs, name):
    hf, one, two = (read_json(runs / run / f"{name}.json") for run in ("hf", "ours1", "ours2"))
    assert one["losses"] == pytest.approx(hf["losses"], abs=1e-5) and len(one["losses"]) == 3
    assert one["eval_loss"] == pytest.approx(hf["eval_loss"], abs=1e-5)
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-5)


def test_label_smoothing_and_optimizers_really_change_the_run(runs):
    plain = read_json(runs / "ours1" / "plain.json")
    smoothed = read_json(runs / "ours1" / "smooth_cls.json")
    assert smoothed["losses"][0] != pytest.approx(plain["losses"][0], abs=1e-4)  # same weights, smoothed loss
    assert read_json(runs / "ours1" / "sgd.json")["optimizer"] == "SGD"
    assert read_json(runs / "ours1" / "rmsprop.json")["optimizer"] == "RMSprop"


def test_neftune_noise_applies_while_training_only(runs):
    plain, noisy = read_json(runs / "ours1" / "plain.json"), read_json(runs / "ours1" / "neftune.json")
    assert noisy["losses"][0] != pytest.approx(plain["losses"][0], abs=1e-5)  # noise in the first forward
    assert noisy["hooks_left"] == 0  # deactivated after train(): evaluation and saving see clean embeddings


def test_batch_eval_metrics_accumulates_over_every_batch_of_every_rank(runs):
    hf, one, two = (read_json(runs / run / "batch_metrics.json") for run in ("hf", "ours1", "ours2"))
    assert hf["rows"] == one["rows"] == two["rows"] == 12  # every eval sample, once
    assert one["accuracy"] == hf["accuracy"] == two["accuracy"]
    assert hf["tensors"] == one["tensors"] == two["tensors"] == 1.0  # batches arrive as tensors, as under HF


def test_include_for_metrics_inputs_gives_the_rows_hugging_face_gives(runs):
    """EvalPrediction.inputs: the eval rows in dataset order, as under transformers (its padding, which depends on
    the batches, aside), on one process and on two ranks."""
    hf, one, two = (read_json(runs / run / "inputs_metrics.json") for run in ("hf", "ours1", "ours2"))
    assert hf["input_rows"] == 4 and hf["input_tokens"] == 3 + 4 + 5 + 6
    for got in (one, two):
        assert (got["input_rows"], got["input_tokens"], got["input_sums"]) == \
            (hf["input_rows"], hf["input_tokens"], hf["input_sums"])
    assert one["eval_loss"] == pytest.approx(hf["eval_loss"], abs=1e-5)


def test_log_level_and_the_running_training_block_are_hugging_faces(tmp_path):
    from launch import ours_and_hf_json

    ours, hf = ours_and_hf_json(Path(__file__).parent / "workers" / "log_block.py", tmp_path)
    assert ours["verbosity"] == hf["verbosity"] == 20  # log_level="info"
    assert ours["block"] == hf["block"]
    assert ours["block"][0] == "***** Running training *****" and len(ours["block"]) >= 8
