"""auto_find_batch_size past Hugging Face's (`workers/auto_batch.py`): a run forced out of memory at its first step
halves its per-device batch, doubles its accumulation steps, and gives the losses and gradient norms of the run
that never had to (1e-6), on one process and on two FSDP ranks together."""

from pathlib import Path

import pytest
from launch import python, read_json, torchrun

WORKER = Path(__file__).parent / "workers" / "auto_batch.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("auto_batch")
    python(WORKER, "plain", str(root / "plain.json"))
    python(WORKER, "forced", str(root / "forced1.json"))
    torchrun(WORKER, 2, "forced", str(root / "forced2.json"))
    return {name: read_json(root / f"{name}.json") for name in ("plain", "forced1", "forced2")}


@pytest.mark.parametrize("run, per_device", [("forced1", 4), ("forced2", 2)])
def test_a_halved_batch_keeps_the_losses_of_the_run_that_never_had_to(runs, run, per_device):
    plain, forced = runs["plain"], runs[run]
    assert forced["train_batch_size"] == forced["state_batch"] == per_device  # halved once, on every rank
    assert forced["sizes"] == [per_device]  # every micro-batch that trained had the smaller size
    assert len(forced["losses"]) == len(plain["losses"]) == 6
    assert forced["losses"] == pytest.approx(plain["losses"], abs=1e-6)
    assert forced["grad_norms"] == pytest.approx(plain["grad_norms"], abs=1e-6)
