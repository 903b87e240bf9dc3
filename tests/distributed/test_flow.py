"""When the Trainer logs, evaluates and saves is Hugging Face's rule, run by Hugging Face's own DefaultFlowCallback:
shardtrain's Trainer fires the same events at the same steps as transformers' (step strategies with
logging_first_step and eval_delay, epoch strategies stopped mid-epoch, a user's callback asking for evaluations
under save_strategy "best"), and removing DefaultFlowCallback turns them off as under transformers
(`workers/flow.py`, one process each)."""

from pathlib import Path

import pytest
from launch import ours_and_hf_json

WORKER = Path(__file__).parent / "workers" / "flow.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ours_and_hf_json(WORKER, tmp_path_factory.mktemp("flow"))


@pytest.mark.parametrize("name", ["steps", "epochs", "best"])
def test_events_and_checkpoints_are_those_of_transformers(runs, name):
    ours, hf = runs
    assert ours[name]["events"] == hf[name]["events"]
    assert ours[name]["checkpoints"] == hf[name]["checkpoints"]
    assert Path(ours[name]["best"] or "x").name == Path(hf[name]["best"] or "x").name


def test_the_rules_are_exercised(runs):
    ours, _ = runs
    steps = [tuple(e) for e in ours["steps"]["events"]]
    assert [s for kind, s, *what in steps if kind == "log" and what == ["loss"]] == [1, 3, 6, 9]  # first step
    assert [s for kind, s, *_ in steps if kind == "evaluate"] == [8, 11]  # eval_delay 5 skips step 4; the end
    assert [s for kind, s, *_ in steps if kind == "save"] == [5, 10, 11]
    epochs = [tuple(e) for e in ours["epochs"]["events"]]
    assert [s for kind, s, *_ in epochs if kind == "save"] == [3, 6, 7]  # the epoch max_steps cut short
    best = [tuple(e) for e in ours["best"]["events"]]
    assert [s for kind, s, *_ in best if kind == "evaluate"] == [2, 3, 5, 6, 8]  # the user's callback's and 3, 6


def test_without_default_flow_callback_nothing_is_logged_evaluated_or_saved(runs):
    ours, hf = runs
    assert [e for e in ours["no_flow"]["events"] if e[0] != "epoch_end"] == [["log", 11, "train"]]
    assert ours["no_flow"]["checkpoints"] == hf["no_flow"]["checkpoints"] == []
    # transformers' own loop stops at max_steps only through that callback: it runs on to the end of the epochs
    # max_steps implies (12 steps); shardtrain stops at max_steps (11)
    assert [e for e in hf["no_flow"]["events"] if e[0] != "epoch_end"] == [["log", 12, "train"]]
