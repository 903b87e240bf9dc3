"""TRL's GRPO, RLOO, KTO and reward trainers on shardtrain's engine (`shardtrain.trl`) on two ranks equal TRL's own
(`workers/trl_rl.py`): the same generations (completion lengths, token counts), rewards, losses and gradient norms.
The reference is TRL on one process where the algorithm does not depend on the layout (the reward trainer, KTO's
apo_zero_unpaired), and TRL on two processes (torchrun) where it does: GRPO and RLOO split prompts per process,
and KTO's default loss clamps each process's KL estimate before averaging them."""

from pathlib import Path

import pytest
from launch import python, read_json, torchrun

WORKER = Path(__file__).parent / "workers" / "trl_rl.py"
ON_TWO = ["grpo", "rloo", "kto"]
ON_ONE = ["kto_apo", "reward"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trl_rl")
    python(WORKER, "trl", str(root / "trl"), ",".join(ON_ONE))
    torchrun(WORKER, 2, "trl", str(root / "trl"), ",".join(ON_TWO))
    torchrun(WORKER, 2, "ours", str(root / "ours"), ",".join(ON_TWO + ON_ONE))
    return root


@pytest.mark.parametrize("case", ON_TWO + ON_ONE)
def test_two_ranks_equal_trl(runs, case):
    ours, ref = read_json(runs / "ours" / f"{case}.json"), read_json(runs / "trl" / f"{case}.json")
    assert len(ours["losses"]) == len(ref["losses"]) == 3
    assert ours["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-5)
    assert ours["grad_norms"][0] > 0  # it trained


@pytest.mark.parametrize("case", ["grpo", "rloo"])
def test_generations_and_rewards_equal_trl_on_two_processes(runs, case):
    ours, ref = read_json(runs / "ours" / f"{case}.json"), read_json(runs / "trl" / f"{case}.json")
    assert ours["completions/mean_length"] == ref["completions/mean_length"]  # the same sampled completions
    assert ours["num_tokens"] == ref["num_tokens"]
    assert ours["reward"] == pytest.approx(ref["reward"], abs=1e-6)
    assert ours["reward_std"] == pytest.approx(ref["reward_std"], abs=1e-6)
    assert len(set(ours["reward"])) > 1  # the rewards moved between steps: generations are not all alike
