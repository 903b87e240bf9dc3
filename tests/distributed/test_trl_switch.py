"""A plain TRL script after the import switch, side by side with TRL's own trainer on one CPU process
(`workers/trl_switch.py`): what TRL's own test files found failing under `shardtrain.trl`.

- SFT saving checkpoints (TRL writes a model card at every save, reading `hub_model_id`) with a dict of eval sets:
  the same evaluation entries (TRL's `eval_entropy`/`eval_mean_token_accuracy` under their eval names), the
  checkpoint holds every file TRL's holds (tokenizer included), the card is written, no process group is left.
- KTO evaluated on a dataset, a dict of datasets and an IterableDataset: the same metrics as TRL's.
- GRPO evaluated (its batches are lists of prompts): the metrics TRL reports.
- GRPO's adaptive entropy coefficient under gradient accumulation moves once per optimizer step, as under TRL
  (it reads Accelerate's `sync_gradients`, which the engine sets per micro-batch as transformers does).
- DPO, reward and KTO with `compute_metrics`: it sees what the library's `prediction_step` returns (DPO's chosen
  and rejected rows, the reward model's scores with no labels named, KTO's logits and input ids), as under TRL.
  On a short last batch, Accelerate's `gather_for_metrics` (under TRL) keeps the first `len(dataset) % batch` rows
  of the batch, which cuts DPO's and the reward model's two rows per sample in half; shardtrain keeps every row.
"""

import json
from pathlib import Path

import pytest
from launch import python

WORKER = Path(__file__).parent / "workers" / "trl_switch.py"
CASES = ("sft_save", "kto_eval", "grpo_eval", "grpo_entropy", "dpo_metrics", "reward_metrics", "kto_metrics")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trl_switch")
    for case in CASES:
        for side in ("trl", "ours"):
            # a fresh process where it matters whether a process group is left behind
            python(WORKER, side, case, str(root), pooled=False if (side, case) == ("ours", "sft_save") else None)
    return root


def result(root: Path, side: str, case: str) -> dict:
    return json.loads((root / f"{side}_{case}.json").read_text())


def test_sft_saves_checkpoints_and_evaluates_a_dict_of_sets_as_trl(runs):
    theirs, ours = result(runs, "trl", "sft_save"), result(runs, "ours", "sft_save")
    assert len(theirs["evals"]) == 4 and "eval_b_loss" in theirs["evals"][1]
    assert ours["evals"] == theirs["evals"]
    assert set(theirs["checkpoint"]) <= set(ours["checkpoint"])
    assert ours["card"] and theirs["card"]
    assert ours["group"] is False


def test_kto_evaluates_every_eval_dataset_form_as_trl(runs):
    theirs, ours = result(runs, "trl", "kto_eval"), result(runs, "ours", "kto_eval")
    assert set(theirs) == {"dataset", "dict", "iterable"} and "eval_x_loss" in theirs["dict"]
    assert ours == theirs


def test_grpo_evaluates_its_prompt_batches(runs):
    theirs, ours = result(runs, "trl", "grpo_eval"), result(runs, "ours", "grpo_eval")
    # transformers adds the time Accelerate took to prepare the model at evaluation; nothing is prepared here
    assert set(ours["keys"]) == set(theirs["keys"]) - {"eval_model_preparation_time"}
    assert "eval_reward" in ours["keys"] and "eval_loss" in ours["keys"]


@pytest.mark.parametrize("case, rows_per_sample", [("dpo_metrics", 2), ("reward_metrics", 2), ("kto_metrics", 1)])
def test_compute_metrics_sees_what_the_prediction_step_returns(runs, case, rows_per_sample):
    theirs, ours = result(runs, "trl", case), result(runs, "ours", case)
    assert ours["even"] == theirs["even"]  # shapes, sums and padding of predictions and label ids
    assert theirs["even"]["seen"]["predictions"]["shape"][0] == 8 * rows_per_sample
    assert ours["short"]["metric"] == theirs["short"]["metric"] == 0.5
    assert ours["short"]["seen"]["predictions"]["shape"][0] == 7 * rows_per_sample  # every row of the 7 samples
    if rows_per_sample == 1:
        assert ours["short"] == theirs["short"]
    else:  # Accelerate's truncation: 4 * 2 rows of the first batch and 3 of the last one's 6
        assert theirs["short"]["seen"]["predictions"]["shape"][0] == 11


def test_grpo_adaptive_entropy_moves_once_per_optimizer_step(runs):
    theirs, ours = result(runs, "trl", "grpo_entropy"), result(runs, "ours", "grpo_entropy")
    assert theirs == {"coef": 0.025, "steps": 3}  # 0.01 + 3 x 0.005
    assert ours == theirs
