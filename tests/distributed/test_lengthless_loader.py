"""A `get_train_dataloader` override whose loader has no length (TRL's GRPO and RLOO on a streamed dataset) is
read as transformers reads it: with max_steps, pass after pass; one process gives transformers' losses, a resume
is bit-identical, and ranks whose loaders run out at different steps are refused (`workers/lengthless_loader.py`).

Where a pass ends on a short step, transformers (5.24) does not know the step is short: it takes no optimizer step
there and carries that micro-batch's gradient and loss into the next pass's first step. shardtrain ends the pass
with the short step, as transformers does for a loader that has a length; the test holds it to that run.
"""

from pathlib import Path

import pytest
from launch import error_lines, python, read_json, torchrun

WORKER = Path(__file__).parent / "workers" / "lengthless_loader.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lengthless")
    python(WORKER, "hf", str(root))
    python(WORKER, "ours", str(root))
    return read_json(root / "ours.json"), read_json(root / "hf.json")


def test_one_process_equals_transformers_trainer(runs):
    ours, hf = runs
    assert len(hf["even16"]["losses"]) == 6 and len(set(hf["even16"]["losses"])) == 6
    assert ours["even16"]["losses"] == pytest.approx(hf["even16"]["losses"], abs=1e-5)
    assert ours["even16"]["position"] == [2, 2]  # three passes of 2 steps


def test_a_short_step_at_the_end_of_a_pass_is_transformers_sized_loaders(runs):
    ours, hf = runs
    assert ours["short20"]["losses"] == pytest.approx(hf["sized20"]["losses"], abs=1e-5)
    assert ours["short20"]["position"] == [1, 3]  # the second pass (2 + 2 + 1 micro-batches) is over
    # transformers' own reading of the lengthless loader folds the short step into the next one (see above)
    assert hf["short20"]["losses"][2] > 1.5 * hf["sized20"]["losses"][2]


@pytest.mark.parametrize("case", ["even16", "short20"])
def test_resume_is_bit_identical(runs, case):
    ours, _ = runs
    assert ours[case]["resumed_losses"][4:] == ours[case]["losses"][4:]
    assert ours[case]["resume_identical"] is True


def test_ranks_whose_loaders_differ_are_refused(tmp_path):
    proc = torchrun(WORKER, 2, "uneven", str(tmp_path), check=False)
    assert proc.returncode != 0
    errors = error_lines(proc.stderr)
    assert any("different numbers of micro-batches for one step ([2, 1])" in line for line in errors), errors
    assert not (tmp_path / "uneven.json").exists()
