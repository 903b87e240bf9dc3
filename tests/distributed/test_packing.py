"""`TrainingArguments(pack_sequences=True)`: the plain Trainer's padding-free packing on two ranks equals
transformers' Trainer with `DataCollatorWithFlattening` on one process (same global batch, accumulation 2),
under FSDP, context parallelism and tensor parallelism; packed training equals padded training; documents in a
packed row restart their positions and do not see each other (`workers/packing.py`)."""

from pathlib import Path

import pytest
from launch import read_json, reference_and_two_ranks

WORKER = Path(__file__).parent / "workers" / "packing.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return reference_and_two_ranks(WORKER, tmp_path_factory.mktemp("packing"), "hf")


@pytest.mark.parametrize("case", ["packed", "packed_cp", "packed_tp", "padded"])
def test_two_ranks_equal_transformers_packed_on_one_process(runs, case):
    ours, ref = read_json(runs / "ours" / f"{case}.json"), read_json(runs / "hf" / "packed.json")
    assert len(ours["losses"]) == len(ref["losses"]) == 3
    assert ours["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-5)


@pytest.mark.parametrize("case", ["packed", "packed_cp", "packed_tp"])
def test_evaluation_after_packed_training_equals_padded(runs, case):
    # evaluation stays padded; the same trained weights give the same eval loss
    ours, padded = read_json(runs / "ours" / f"{case}.json"), read_json(runs / "ours" / "padded.json")
    assert ours["eval_loss"] == pytest.approx(padded["eval_loss"], abs=1e-5)


def test_packed_rows_restart_positions_and_keep_documents_apart(runs):
    packed = read_json(runs / "ours" / "packed.json")
    positions = packed["position_ids"]
    assert positions.count(0) == 4  # the 4 documents of the micro-batch, each counting from 0
    assert all(b in (a + 1, 0) for a, b in zip(positions, positions[1:], strict=False))
    assert packed["document_gap"] < 1e-5  # a document's logits are those it has alone
