"""lr_scheduler_type "reduce_lr_on_plateau" and "greedy" step on the evaluation metric after each evaluation, as
under transformers' Trainer (`workers/metric_schedulers.py`): the same learning rates and losses on one process,
and on two FSDP ranks (every rank steps on the same, agreed metric)."""

from pathlib import Path

import pytest
from launch import ours_and_hf_json, read_json, torchrun

WORKER = Path(__file__).parent / "workers" / "metric_schedulers.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("metric_schedulers")
    ours, hf = ours_and_hf_json(WORKER, root)
    torchrun(WORKER, 2, "ours", str(root / "ours2.json"))
    return {"ours": ours, "hf": hf, "ours2": read_json(root / "ours2.json")}


@pytest.mark.parametrize("which", ["ours", "ours2"])
@pytest.mark.parametrize("kind", ["reduce_lr_on_plateau", "greedy"])
def test_learning_rates_and_losses_equal_hugging_face(runs, which, kind):
    ours, hf = runs[which][kind], runs["hf"][kind]
    assert ours["lrs"] == pytest.approx(hf["lrs"], rel=1e-9)
    assert ours["losses"] == pytest.approx(hf["losses"], abs=1e-5)
    assert ours["eval_losses"] == pytest.approx(hf["eval_losses"], abs=1e-5)


def test_the_plateau_scheduler_cut_the_rate(runs):
    assert runs["hf"]["reduce_lr_on_plateau"]["lrs"][-1] == pytest.approx(1e-4)  # two cuts by 10
