"""`model.generate` on an FSDP2-sharded model returns the unsharded model's tokens (greedy with and without KV
cache, sampling with a fixed seed, plain and LoRA), and finishes when the ranks stop at different lengths."""

import json
from pathlib import Path

import pytest
from launch import torchrun

WORKER = Path(__file__).parent / "workers" / "generate.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("generate")
    torchrun(WORKER, 2, str(out), timeout=300)  # a rank left waiting in an all-gather would hit this time-out
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_sharded_generate_equals_unsharded(ranks):
    cases = [case for rank in ranks for case in rank]
    assert len(cases) == 12
    for case in cases:
        assert case["got"] == case["expected"], case


def test_ranks_finish_at_different_lengths(ranks):
    for lora in (False, True):
        greedy = [next(c for c in rank if c["lora"] is lora and c["case"] == "greedy") for rank in ranks]
        first, second = (len(c["got"]) for c in greedy)
        assert greedy[0]["got"][-1] == greedy[0]["eos"]  # rank 0 stopped at its EOS ...
        assert second >= first + 5  # ... at least 5 tokens before rank 1 stopped
