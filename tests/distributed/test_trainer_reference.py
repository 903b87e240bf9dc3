"""The Trainer's step equals a hand-written mean-token-loss + clip + AdamW loop (one process, FSDP off and on,
fused and foreach AdamW)."""

import json
from pathlib import Path

import pytest
from launch import python

WORKER = Path(__file__).parent / "workers" / "trainer_reference.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out.json"
    python(WORKER, str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("fsdp,optim", [(False, "adamw_torch_fused"), (True, "adamw_torch_fused"),
                                        (True, "adamw_torch")])
def test_trainer_steps_equal_the_reference_loop(result, fsdp, optim):
    got = result[f"fsdp={fsdp},{optim}"]
    assert got["fused"] == (optim == "adamw_torch_fused")
    assert got["max_weight_change"] > 1e-3  # the steps really moved the weights
    assert got["max_weight_diff"] < 1e-6
    assert got["grad_norms"] == pytest.approx(result["reference_grad_norms"], rel=1e-5)
    assert max(result["reference_grad_norms"]) > 0.5  # clipping (max_grad_norm 0.5) was active
