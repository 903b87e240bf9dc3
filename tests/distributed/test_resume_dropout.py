"""Resume is bit-identical for a model with dropout (GPT-2, p=0.1), also with a collator that draws random
numbers and a DataLoader worker: on 1 and 2 ranks, for both checkpoint types."""

import json
import shutil
from pathlib import Path

import pytest
from launch import python, torchrun

WORKER = Path(__file__).parent / "workers" / "train_run.py"
TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
VARIANTS = {"plain": {}, "random_collator": {"random_collator": True, "dataloader_num_workers": 1}}


def _result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


def _job(root: Path, nproc: int, name: str, variant: str, kind: str | None, **extra) -> dict:
    saving = {"save_strategy": "steps", "save_steps": 3, "fsdp_config": {"state_dict_type": kind}} if kind else {}
    return {"model": "gpt2", "per_device_train_batch_size": 8 // nproc, "max_steps": 6, "dataset_size": 64,
            **VARIANTS[variant], **saving, "out": str(root / f"{nproc}-{variant}-{name}"), **extra}


def _run(nproc: int, jobs: list[dict]) -> None:
    if nproc == 1:
        python(WORKER, json.dumps(jobs))
    else:
        torchrun(WORKER, nproc, json.dumps(jobs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropout")
    for nproc in (1, 2):
        first = [_job(root, nproc, "reference", v, None) for v in VARIANTS]
        first += [_job(root, nproc, kind, v, kind, stop_after=3) for v in VARIANTS for kind in TYPES]
        second = [_job(root, nproc, kind, v, kind, resume=str(root / f"{nproc}-{v}-{kind}" / "checkpoint-3"))
                  for v in VARIANTS for kind in TYPES]
        _run(nproc, first)
        for v in VARIANTS:
            for kind in TYPES:
                shutil.copy(root / f"{nproc}-{v}-{kind}" / "result.json", root / f"{nproc}-{v}-{kind}" / "first.json")
        _run(nproc, second)
    return root


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", TYPES)
def test_dropout_resume_is_bit_identical(runs, nproc, variant, kind):
    ref = _result(runs / f"{nproc}-{variant}-reference")
    first = json.loads((runs / f"{nproc}-{variant}-{kind}" / "first.json").read_text())
    resumed = _result(runs / f"{nproc}-{variant}-{kind}")
    assert ref["steps"] == [1, 2, 3, 4, 5, 6] and first["steps"] == [1, 2, 3]
    assert first["losses"] == ref["losses"][:3]
    assert resumed["steps"] == [1, 2, 3, 4, 5, 6]
    assert resumed["losses"][3:] == ref["losses"][3:]  # exact equality
    assert resumed["grad_norms"][3:] == ref["grad_norms"][3:]
    assert resumed["eval_loss"] == ref["eval_loss"]

