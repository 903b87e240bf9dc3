"""TRL's SFT (prompt-completion, completion-only loss, unpacked and packed) and DPO on shardtrain's engine
(`shardtrain.trl`) on two ranks equal TRL's own trainers on one process with the same global batch
(`workers/trl_runs.py`); packed rows restart their position_ids and their documents do not see each other.
"""

from pathlib import Path

import pytest
from launch import read_json, reference_and_two_ranks

WORKER = Path(__file__).parent / "workers" / "trl_runs.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return reference_and_two_ranks(WORKER, tmp_path_factory.mktemp("trl"), "trl")


@pytest.mark.parametrize("case", ["sft", "sft_packed", "dpo", "dpo_path", "dpo_path_meta", "sft_auto"])
def test_two_ranks_equal_trl_on_one_process(runs, case):
    reference = {"sft_auto": "sft"}.get(case, case)  # any layout trains alike
    ours, ref = read_json(runs / "ours" / f"{case}.json"), read_json(runs / "trl" / f"{reference}.json")
    assert len(ours["losses"]) == len(ref["losses"]) >= 3
    assert ours["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-5)
    assert ours["losses"][-1] < ours["losses"][0]  # it learned
    # placeholder micro-batches (the packed epoch's short end) are left out of gather_for_metrics, as Accelerate
    # leaves out the samples that even out batches: the tokens seen are the one process's
    assert ours["num_tokens"] == ref["num_tokens"]
    if "eval_loss" in ref:
        assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)


def test_auto_layout_under_trls_process_group_picks_a_layout(runs):
    """TRL starts the process group before the Trainer; "auto" traced in a fresh process and chose (the losses:
    test_two_ranks_equal_trl_on_one_process[sft_auto])."""
    got = read_json(runs / "ours" / "sft_auto.json")
    layout = got["layout"]
    assert got["group_was_up"]  # so the planner traced in a fresh process
    assert layout.split(",")[0] in ("no_shard", "shard_grad_op", "full_shard", "no_shard_one_unit")


def test_packed_rows_keep_documents_apart(runs):
    packed = read_json(runs / "ours" / "sft_packed.json")
    positions = packed["position_ids"]
    assert positions.count(0) >= 2  # several documents in the row, each counting from 0
    assert all(b in (a + 1, 0) for a, b in zip(positions, positions[1:], strict=False))
    assert packed["document_gap"] < 1e-5  # a document's logits are those it has alone


@pytest.mark.parametrize("case", ["dpo", "dpo_path", "dpo_path_meta"])
def test_dpo_reference_model_is_sharded(runs, case):
    assert read_json(runs / "ours" / f"{case}.json")["ref_sharded"] is True


def test_models_trl_loads_by_path_are_built_on_meta_and_read_by_shards(runs):
    """cpu_ram_efficient_loading: TRL's from_pretrained of the policy and of the reference model reads nothing
    (device_map="meta"); each rank reads its shards of both; the user's model_init_kwargs are left as they were."""
    got = read_json(runs / "ours" / "dpo_path_meta.json")
    assert got["read_into_meta"] == 2 and got["model_init_kwargs"] is None


def test_missing_extra_names_it(tmp_path):
    import subprocess
    import sys

    code = "import sys; sys.modules['trl'] = None; import shardtrain.trl"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "pip install 'shardtrain[trl]'" in done.stderr
