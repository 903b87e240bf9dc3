"""Hugging Face's checkpoint files (`shardtrain.checkpoint.hf_files`): read with weights_only only, an optimizer
state by position matched to parameter names, RNG states in transformers' format."""

import random

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_llama

from shardtrain.checkpoint import hf_files
from shardtrain.errors import CheckpointError
from shardtrain.train.step.optim import build_optimizer


class Payload:
    """An object whose unpickling would run code: it must never be unpickled."""

    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['PWNED']).write_text('x')",))


def test_an_optimizer_file_holding_objects_is_refused_unread(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PWNED", str(marker))
    torch.save({"state": {}, "param_groups": [], "extra": Payload()}, tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer.pt with torch.load\(weights_only=True\)"):
        hf_files.load_tensors(tmp_path / "optimizer.pt")
    assert not marker.exists()


def test_a_truncated_file_names_the_file(tmp_path):
    torch.save({"a": torch.ones(100)}, tmp_path / "scheduler.pt")
    (tmp_path / "scheduler.pt").write_bytes((tmp_path / "scheduler.pt").read_bytes()[:50])
    with pytest.raises(CheckpointError, match="scheduler.pt"):
        hf_files.load_tensors(tmp_path / "scheduler.pt")


def hf_optimizer(model):
    """transformers' own optimizer for `model` (its grouping), after one step so that it has state."""
    args = transformers.TrainingArguments("unused", weight_decay=0.1, report_to=[], use_cpu=True)
    optimizer = transformers.Trainer(model=model, args=args).create_optimizer()
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    return optimizer


def test_positions_become_the_parameter_names_of_our_groups(tmp_path):
    saved = hf_optimizer(tiny_llama(tie=True)).state_dict()
    model = tiny_llama(tie=True)
    ours = build_optimizer(model, decay_names=transformers.Trainer.get_decay_parameter_names(None, model),
                           weight_decay=0.1, cls=torch.optim.AdamW, kwargs={"lr": 1e-3})
    names = {param: name for name, param in model.named_parameters()}
    full = hf_files.optimizer_state_by_name(saved, ours, names, tmp_path / "optimizer.pt")
    flat = [name for group in full["param_groups"] for name in group["params"]]
    assert flat == [names[p] for group in ours.param_groups for p in group["params"]]
    assert "lm_head.weight" not in flat  # tied to the embedding: one parameter, under its first name
    position = saved["param_groups"][1]["params"][0]
    first_no_decay = full["param_groups"][1]["params"][0]
    assert torch.equal(full["state"][first_no_decay]["exp_avg"], saved["state"][position]["exp_avg"])
    assert full["param_groups"][0]["weight_decay"] == 0.1 and full["param_groups"][1]["weight_decay"] == 0.0


def test_another_model_is_refused_with_the_reason(tmp_path):
    saved = hf_optimizer(tiny_llama(hidden=48)).state_dict()
    model = tiny_llama()
    ours = build_optimizer(model, decay_names=transformers.Trainer.get_decay_parameter_names(None, model),
                           weight_decay=0.1, cls=torch.optim.AdamW, kwargs={"lr": 1e-3})
    names = {param: name for name, param in model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"has shape \(64, 48\), the parameter \(64, 32\)"):
        hf_files.optimizer_state_by_name(saved, ours, names, tmp_path / "optimizer.pt")
    deeper = tiny_llama(layers=3)
    with pytest.raises(CheckpointError, match="parameter groups of"):
        hf_files.optimizer_state_by_name(hf_optimizer(deeper).state_dict(), ours, names, tmp_path / "optimizer.pt")


def test_rng_states_round_trip_in_transformers_format(tmp_path):
    hf_files.save_rng(tmp_path, rank=0, world_size=1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(1)  # move every generator on
    hf_files.set_rng(hf_files.load_tensors(tmp_path / "rng_state.pth"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert hf_files.rng_file(1, 2) == "rng_state_1.pth"
