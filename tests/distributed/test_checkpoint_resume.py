"""Resume equals no interruption: bit-identical on the same ranks, 1e-6 on 1 and 4 ranks (sharded)."""

import json
import shutil
from pathlib import Path

import pytest
import transformers
from launch import python, torchrun

WORKER = Path(__file__).parent / "workers" / "train_run.py"
TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")


def _result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")

    def knobs(kind: str) -> dict:
        return {"out": str(root / kind), "per_device_train_batch_size": 4, "save_strategy": "steps",
                "save_steps": 5, "fsdp_config": {"state_dict_type": kind}}

    first_halves = [{**knobs(kind), "stop_after": 5} for kind in TYPES]
    torchrun(WORKER, 2, json.dumps([{"out": str(root / "uninterrupted"), "per_device_train_batch_size": 4},
                                    *first_halves]))
    for kind in TYPES:
        shutil.copytree(root / kind, root / f"{kind}-first-half")
    # a new process: model, optimizer, scheduler, RNG and data position come from disk only
    torchrun(WORKER, 2, json.dumps([{**knobs(kind), "resume": True} for kind in TYPES]))
    sharded = {"save_strategy": "no", "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"},
               "resume": str(root / "SHARDED_STATE_DICT-first-half" / "checkpoint-5")}
    python(WORKER, json.dumps([{**sharded, "out": str(root / "on1"), "per_device_train_batch_size": 8}]))
    torchrun(WORKER, 4, json.dumps([{**sharded, "out": str(root / "on4"), "per_device_train_batch_size": 2}]))
    return root


@pytest.mark.parametrize("kind", TYPES)
def test_resume_is_bit_identical(runs, kind):
    ref = _result(runs / "uninterrupted")
    first = _result(runs / f"{kind}-first-half")
    second = _result(runs / kind)
    assert first["steps"] == [1, 2, 3, 4, 5] and second["steps"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert first["losses"] == ref["losses"][:5]
    assert second["losses"][5:] == ref["losses"][5:]  # exact equality, not a tolerance
    assert second["grad_norms"][5:] == ref["grad_norms"][5:]
    assert second["eval_loss"] == ref["eval_loss"]


@pytest.mark.parametrize("kind", TYPES)
def test_checkpoint_layout(runs, kind):
    ckpt = runs / f"{kind}-first-half" / "checkpoint-5"
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "trainer_state.json", "scheduler.json", "rng_state_0.pt", "rng_state_1.pt"} <= names
    if kind == "SHARDED_STATE_DICT":
        assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    else:
        assert "model.safetensors" in names
        assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    engine = json.loads((ckpt / "shardtrain_state.json").read_text())
    assert state["global_step"] == 5 and engine["global_batch_size"] == 8 and "global_batch_size" not in state
    assert transformers.TrainerState.load_from_json(str(ckpt / "trainer_state.json")).global_step == 5
    assert not [p for p in (runs / kind).iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("run", ["on1", "on4"])
def test_sharded_checkpoint_resumes_on_another_world_size(runs, run):
    ref = _result(runs / "uninterrupted")
    got = _result(runs / run)
    assert got["steps"] == list(range(1, 11))  # log history comes back from the checkpoint
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6, rel=0)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-6)
