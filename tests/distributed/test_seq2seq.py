"""transformers' `Seq2SeqTrainer` on shardtrain's engine (`shardtrain.on_engine`): a tiny T5 on two FSDP2 ranks
trains, evaluates and generates (beams, `predict(max_length=..., num_beams=...)`, ranks finishing apart) exactly
as `Seq2SeqTrainer` on one process (`workers/seq2seq.py`)."""

from pathlib import Path

import pytest
from launch import read_json, reference_and_two_ranks

WORKER = Path(__file__).parent / "workers" / "seq2seq.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = reference_and_two_ranks(WORKER, tmp_path_factory.mktemp("seq2seq"), "hf")
    return read_json(root / "hf" / "t5.json"), read_json(root / "ours" / "t5.json")


def test_training_and_eval_loss_equal_seq2seq_trainer(runs):
    hf, ours = runs
    assert len(ours["losses"]) == 3 and ours["losses"][-1] < ours["losses"][0]
    assert ours["losses"] == pytest.approx(hf["losses"], abs=1e-5)
    assert ours["eval_loss"] == pytest.approx(hf["eval_loss"], abs=1e-5)


def test_generated_tokens_are_identical(runs):
    hf, ours = runs
    assert ours["generated"] == hf["generated"] and len(ours["generated"]) == 8
    assert ours["short"] == hf["short"]
    assert ours["short"] != ours["generated"]  # max_length / num_beams of predict() were applied
