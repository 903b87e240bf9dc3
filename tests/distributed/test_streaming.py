"""Streams (a torch IterableDataset, a `datasets` streaming dataset) with max_steps: shardtrain on one process
equals transformers' Trainer over two passes with short last steps; two ranks equal one process; resuming inside
a pass or in the next one is bit-identical to the uninterrupted run, dropout included; evaluation and prediction
on a stream give transformers' predictions and labels in stream order, on one process and two ranks, and the loss
of the same samples as a list (`workers/streaming.py`).
"""

from pathlib import Path

import pytest
from launch import python, read_json, torchrun

WORKER = Path(__file__).parent / "workers" / "streaming.py"
KINDS = ("torch", "datasets")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    python(WORKER, "hf", str(root / "hf"))
    python(WORKER, "ours", str(root / "ours1"))
    torchrun(WORKER, 2, "ours", str(root / "ours2"))
    return root


@pytest.mark.parametrize("kind", KINDS)
def test_one_process_equals_transformers_trainer(runs, kind):
    ours, hf = read_json(runs / "ours1" / f"{kind}_plain.json"), read_json(runs / "hf" / f"{kind}_plain.json")
    assert len(ours["losses"]) == len(hf["losses"]) == 6
    assert ours["losses"] == pytest.approx(hf["losses"], abs=1e-5)
    assert ours["position"] == [1, 3]  # the second pass, after its 3 steps (8 + 8 + 4 samples)


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one_process(runs, kind):
    one, two = read_json(runs / "ours1" / f"{kind}_plain.json"), read_json(runs / "ours2" / f"{kind}_plain.json")
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)


@pytest.mark.parametrize("run", ["ours1", "ours2"])
@pytest.mark.parametrize("kind", KINDS)
def test_resume_is_bit_identical(runs, run, kind):
    result = read_json(runs / run / f"{kind}_dropout.json")
    assert result["resume_identical"] == {"2": True, "4": True}
    assert len(set(result["losses"])) == 6


@pytest.mark.parametrize("kind", KINDS)
def test_predict_on_a_stream_equals_transformers_and_the_list(runs, kind):
    hf = read_json(runs / "hf" / "torch_plain.json")[f"predict_{kind}"]
    for run in ("ours1", "ours2"):
        got = read_json(runs / run / "torch_plain.json")
        stream, listed = got[f"predict_{kind}"], got["predict_list"]
        assert len(stream["labels"]) == 13 and stream["labels"] == hf["labels"] == listed["labels"]  # stream order
        assert stream["argmax"] == hf["argmax"]
        assert stream["logit_sums"] == pytest.approx(hf["logit_sums"], abs=1e-3)
        assert stream["logit_sums"] == pytest.approx(listed["logit_sums"], abs=1e-4)
        assert stream["loss"] == pytest.approx(listed["loss"], abs=1e-6)  # the exact token mean, as for a list
