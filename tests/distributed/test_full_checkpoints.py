"""Full checkpoints load with transformers; merge equals save_model; clear load errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import python, torchrun
from safetensors.torch import load_file
from transformers import BertForSequenceClassification, LlamaForCausalLM

from shardtrain.checkpoint import CheckpointError
from shardtrain.checkpoint.merge import merge_checkpoint

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    common = {"per_device_train_batch_size": 4, "max_steps": 4, "save_strategy": "steps", "save_steps": 4,
              "probe": True}
    torchrun(WORKERS / "train_run.py", 2, json.dumps([
        {**common, "out": str(root / "llama"), "save_model": str(root / "llama" / "final"),
         "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}},
        {**common, "out": str(root / "tied"), "model": "llama_tied", "save_model": str(root / "tied" / "final"),
         "fsdp_config": {"activation_checkpointing": True}},
        {**common, "out": str(root / "bert"), "max_steps": 3, "save_steps": 3, "model": "bert",
         "save_model": str(root / "bert" / "final"), "fsdp_config": {"transformer_layer_cls_to_wrap": "BertLayer"},
         "learning_rate": 1e-4}]))
    return root


def _probe_matches(model, run: Path) -> None:
    probe = torch.load(run / "probe.pt")
    with torch.no_grad():
        logits = model.eval()(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("run", ["llama", "tied"])
def test_llama_from_pretrained_round_trip(trained, run):
    final = trained / run / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    model = LlamaForCausalLM.from_pretrained(str(final))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (run == "tied")
    _probe_matches(model, trained / run)


def test_bert_fine_tuned_on_two_ranks_reloads_with_transformers(trained):
    model = BertForSequenceClassification.from_pretrained(str(trained / "bert" / "final"))
    _probe_matches(model, trained / "bert")
    result = json.loads((trained / "bert" / "result.json").read_text())
    assert result["global_step"] == 3


@pytest.mark.parametrize("run", ["llama", "tied"])
def test_merge_equals_save_model(trained, run, tmp_path):
    merged = merge_checkpoint(trained / run / "checkpoint-4", tmp_path / "merged")
    ours, theirs = load_file(merged / "model.safetensors"), load_file(trained / run / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert json.loads((merged / "config.json").read_text()) == json.loads(
        (trained / run / "final" / "config.json").read_text())


def test_merge_command_line(trained, tmp_path):
    cmd = [sys.executable, "-m", "shardtrain.cli.main", "merge", str(trained / "llama" / "checkpoint-4"),
           str(tmp_path / "merged")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"))
    _probe_matches(model, trained / "llama")


def test_merge_refuses_bad_input(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        merge_checkpoint(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        merge_checkpoint(trained / "llama" / "checkpoint-4", tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="holds no model"):
        merge_checkpoint(tmp_path / "busy", tmp_path / "out2")


def test_split_safetensors_with_index(tmp_path):
    from shardtrain.checkpoint.full import read_full_checkpoint, write_full_checkpoint

    state = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}
    files = write_full_checkpoint(state, tmp_path, {"model_type": "x"}, max_shard_bytes=64 * 64 * 4 * 2)
    assert "model.safetensors.index.json" in files and "model-00002-of-00002.safetensors" in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["layer3.weight"] == "model-00002-of-00002.safetensors"
    back = read_full_checkpoint(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_bad_resumes_fail_clearly(trained, tmp_path):
    out = tmp_path / "errors.json"
    python(WORKERS / "bad_resumes.py", str(out), str(trained / "llama" / "checkpoint-4"),
           str(trained / "tied" / "checkpoint-4"))
    errors = json.loads(out.read_text())
    assert "model.embed_tokens.weight" in errors["wider_model"] and "shape" in errors["wider_model"]
    assert "model.layers.2" in errors["deeper_model"] and "missing" in errors["deeper_model"]
    assert "FSDP is off" in errors["fsdp_off"] and "fsdp=True" in errors["fsdp_off"]
    assert "__0_0.distcp has 100 bytes" in errors["truncated_shard"] and "truncated" in errors["truncated_shard"]
    assert "model.safetensors has 1000 bytes" in errors["truncated_safetensors"]
    assert "manifest.json is missing" in errors["not_a_checkpoint"]
