"""transformers' `Seq2SeqTrainer` on shardtrain's engine (`shardtrain.on_engine`): a tiny T5 and a tiny BART, each
with `DataCollatorForSeq2Seq` and with the default collator, on two FSDP2 ranks train, evaluate and generate
(beams, `predict(max_length=..., num_beams=...)`, ranks finishing apart) exactly as `Seq2SeqTrainer` on one
process (`workers/seq2seq.py`)."""

from pathlib import Path

import pytest
from launch import read_json, reference_and_two_ranks

WORKER = Path(__file__).parent / "workers" / "seq2seq.py"


CASES = ["t5", "t5_default", "bart", "bart_default"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return reference_and_two_ranks(WORKER, tmp_path_factory.mktemp("seq2seq"), "hf")


@pytest.fixture(params=CASES)
def runs(root, request):
    return read_json(root / "hf" / f"{request.param}.json"), read_json(root / "ours" / f"{request.param}.json")


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
