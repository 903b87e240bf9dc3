"""`TrainingArguments(torch_compile=True)`: each FSDP unit (decoder layer) is compiled with inductor before it is
sharded; 10 steps on 2 ranks equal eager training (losses, gradient norms, weights 1e-5)."""

import json
from pathlib import Path

import pytest
from launch import assert_same_training, run_result, torchrun

WORKER = Path(__file__).parent / "workers" / "train_run.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    torchrun(WORKER, 2, json.dumps([
        {"out": str(root / "eager"), "per_device_train_batch_size": 4, "weights": True},
        {"out": str(root / "compiled"), "per_device_train_batch_size": 4, "weights": True, "torch_compile": True}]))
    return root


def test_compiled_units_train_like_eager(runs):
    assert_same_training(runs, "eager", "compiled", tol=1e-5)


def test_each_decoder_layer_is_compiled(runs):
    assert run_result(runs, "eager")["compiled_modules"] == []
    assert run_result(runs, "compiled")["compiled_modules"] == ["model.layers.0", "model.layers.1"]
