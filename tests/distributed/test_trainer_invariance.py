"""The training trajectory depends on the global batch only: 1x8, 2x4, 2x2 (accumulation 2), 4x2 agree,
also when gradient shards are replicated (HSDP 2x2, no_shard), which the gradient norm must count once."""

import json
from pathlib import Path

import pytest
from launch import python, torchrun

WORKER = Path(__file__).parent / "workers" / "train_run.py"
SPLITS = {  # name: (ranks, per-device batch, accumulation, fsdp_config)
    "1x8": (1, 8, 1, {}),
    "2x4": (2, 4, 1, {}),
    "2x2x2": (2, 2, 2, {}),
    "4x2": (4, 2, 1, {}),
    "4x2_hsdp": (4, 2, 1, {"sharding_strategy": "hybrid_shard", "dp_shard_size": 2}),
    "4x2_no_shard": (4, 2, 1, {"sharding_strategy": "no_shard"}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    for ranks in (1, 2, 4):
        jobs = json.dumps([{"out": str(root / name), "per_device_train_batch_size": batch,
                            "gradient_accumulation_steps": accum, "fsdp_config": fsdp_config}
                           for name, (world, batch, accum, fsdp_config) in SPLITS.items() if world == ranks])
        if ranks == 1:
            python(WORKER, jobs)  # a plain single process: no launcher
        else:
            torchrun(WORKER, ranks, jobs)
    return {name: json.loads((root / name / "result.json").read_text()) for name in SPLITS}


@pytest.mark.parametrize("name", [n for n in SPLITS if n != "1x8"])
def test_log_history_matches_single_process(results, name):
    ref, got = results["1x8"], results[name]
    assert got["steps"] == ref["steps"] == list(range(1, 11))
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-5, rel=1e-5)
    assert got["lrs"] == pytest.approx(ref["lrs"], abs=1e-12)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)


def test_learning_rate_schedule_and_losses_are_real(results):
    ref = results["1x8"]
    # the rate each step used (as Hugging Face logs it): 2 warmup steps from 0, then linear decay towards 0
    assert ref["lrs"][:4] == pytest.approx([0.0, 0.005, 0.01, 0.00875])
    assert ref["lrs"][-1] == pytest.approx(0.00125)
    assert len(set(ref["losses"])) == len(ref["losses"])
