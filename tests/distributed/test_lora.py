"""LoRA (peft) under FSDP2: 2 ranks equal one process, the frozen base never changes, the adapter saved from 2
ranks is whole (every rank's shard), it and the merged export load with peft / transformers and give the trained
model's logits, and adapter-only sharded checkpoints resume bit-identically, on another world size, and refuse
another base model."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import python, torchrun
from safetensors.torch import load_file
from tiny_models import tiny_llama

WORKER = Path(__file__).parent / "workers" / "train_run.py"
SHARDED = {"state_dict_type": "SHARDED_STATE_DICT"}


def _job(out: Path, batch: int, **extra) -> dict:
    return {"out": str(out), "per_device_train_batch_size": batch, "lora": True, "weights": True, "probe": True,
            "save_model": str(out / "adapter"), "save_merged": str(out / "merged"), "save_strategy": "steps",
            "save_steps": 5, "fsdp_config": SHARDED, **extra}


def _resume_dir(root: Path, name: str, source: Path) -> Path:
    out = root / name
    out.mkdir()
    shutil.copytree(source / "checkpoint-5", out / "checkpoint-5")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    torchrun(WORKER, 2, json.dumps([_job(root / "two", 4),
                                    {"out": str(root / "two_ac"), "per_device_train_batch_size": 4, "lora": True,
                                     "fsdp_config": {"activation_checkpointing": True}},
                                    {"out": str(root / "two_gc"), "per_device_train_batch_size": 4,
                                     "peft_model": True, "gradient_checkpointing": True},
                                    {"out": str(root / "two_bf16"), "per_device_train_batch_size": 4, "lora": True,
                                     "base_bf16": True, "bf16": True, "max_steps": 2, "save_strategy": "steps",
                                     "save_steps": 2, "fsdp_config": SHARDED},
                                    {"out": str(root / "two_cp"), "per_device_train_batch_size": 8, "lora": True,
                                     "cp_size": 2},
                                    {**_job(root / "two_full", 4), "fsdp_config": {}}]))
    two_again = _resume_dir(root, "resumed2", root / "two")
    on1 = _resume_dir(root, "on1", root / "two")
    full_again = _resume_dir(root, "full_resumed2", root / "two_full")
    torchrun(WORKER, 2, json.dumps([{**_job(two_again, 4), "resume": True},
                                    {**_job(full_again, 4), "fsdp_config": {}, "resume": True}]))
    python(WORKER, json.dumps([_job(root / "one", 8), {**_job(on1, 8), "resume": True}]))
    other_base = _resume_dir(root, "other_base", root / "two")
    failed = python(WORKER, json.dumps([{**_job(other_base, 8), "resume": True, "model_seed": 1}]), check=False)
    return root, failed


def _result(root: Path, name: str) -> dict:
    return json.loads((root / name / "result.json").read_text())


def test_two_ranks_equal_one_process_and_the_base_stays_frozen(runs):
    root, _ = runs
    one, two = _result(root, "one"), _result(root, "two")
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5, rel=0)
    for name in ("two_ac", "two_gc", "two_cp"):  # frozen base + activation / gradient checkpointing; a PeftModel
        # given directly; the adapters under context parallelism
        assert _result(root, name)["losses"] == pytest.approx(one["losses"], abs=1e-5, rel=0), name
    assert len(set(one["losses"])) == 10
    w1, w2 = torch.load(root / "one" / "weights.pt"), torch.load(root / "two" / "weights.pt")
    lora_keys = sorted(k for k in w1 if "lora_" in k)
    assert len(lora_keys) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert max((w1[k] - w2[k]).abs().max().item() for k in lora_keys) < 1e-5
    assert max(w2[k].abs().max().item() for k in lora_keys if "lora_B" in k) > 1e-4  # B starts at 0: it trained
    initial = tiny_llama().state_dict()
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in w2.items() if "lora_" not in k}
    assert base.keys() == initial.keys()
    for key, value in initial.items():
        assert torch.equal(base[key], value), key  # bit for bit


def test_adapter_from_two_ranks_is_whole_and_loads_with_peft(runs):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    root, _ = runs
    one = load_file(str(root / "one" / "adapter" / "adapter_model.safetensors"))
    two = load_file(str(root / "two" / "adapter" / "adapter_model.safetensors"))
    assert one.keys() == two.keys() and len(two) == 8
    for key in one:
        assert one[key].shape == two[key].shape  # a rank-0-only slice would be half as long
        assert (one[key] - two[key]).abs().max().item() < 1e-5, key
    probe = torch.load(root / "two" / "probe.pt")
    inputs = {"input_ids": probe["input_ids"], "attention_mask": probe["attention_mask"]}
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(tiny_llama(), str(root / "two" / "adapter")).eval()
        merged = LlamaForCausalLM.from_pretrained(str(root / "two" / "merged")).eval()
        for model in (adapted, merged):
            logits = model(**inputs).logits
            keep = probe["attention_mask"].bool()
            assert (logits[keep] - probe["logits"][keep]).abs().max().item() < 1e-5


def test_adapter_checkpoints_hold_the_adapters_and_name_their_base(runs):
    from shardtrain.checkpoint.safe_load import read_dcp_metadata

    root, _ = runs
    checkpoint = root / "two" / "checkpoint-5"
    base = json.loads((checkpoint / "base_model.json").read_text())
    assert base["base_class"] == "LlamaForCausalLM" and len(base["frozen_sha256"]) == 64
    keys = [k for k in read_dcp_metadata(checkpoint / "sharded").state_dict_metadata if k.startswith("model.")]
    assert keys and all("lora_" in k for k in keys)


def test_lora_checkpoint_resumes_exactly_and_on_another_world_size(runs):
    root, _ = runs
    full = _result(root, "two_full")  # FULL_STATE_DICT: model.safetensors holds the adapters only
    assert full["losses"] == _result(root, "two")["losses"]
    assert _result(root, "full_resumed2")["losses"][5:] == full["losses"][5:]
    saved = load_file(str(root / "two_full" / "checkpoint-5" / "model.safetensors"))
    assert len(saved) == 8 and all("lora_" in k for k in saved)
    two, resumed, on1 = _result(root, "two"), _result(root, "resumed2"), _result(root, "on1")
    assert resumed["losses"][5:] == two["losses"][5:]  # bit-identical
    assert on1["losses"][5:] == pytest.approx(two["losses"][5:], abs=1e-6, rel=0)
    assert torch.equal(torch.load(root / "resumed2" / "weights.pt")["base_model.model.lm_head.weight"],
                       torch.load(root / "two" / "weights.pt")["base_model.model.lm_head.weight"])


def test_resume_on_another_base_is_refused(runs):
    root, failed = runs
    assert failed.returncode != 0
    assert "was trained on base LlamaForCausalLM with frozen weights" in failed.stderr
    assert "load the same base model" in failed.stderr
    assert not (root / "other_base" / "result.json").exists()


def test_merge_lora_checkpoint_with_its_base(runs, tmp_path, capsys):
    from transformers import LlamaForCausalLM

    from shardtrain.cli.main import main

    root, _ = runs
    base, other = tmp_path / "base", tmp_path / "other"
    tiny_llama().save_pretrained(str(base))
    tiny_llama(seed=1).save_pretrained(str(other))
    checkpoint = root / "two" / "checkpoint-10"
    assert main(["merge", str(checkpoint), str(tmp_path / "no_base")]) == 2  # adapters alone are not a model
    assert "holds LoRA adapters only; pass --merge-lora --base DIR" in capsys.readouterr().err
    assert main(["merge", str(checkpoint), str(tmp_path / "wrong"), "--merge-lora", "--base", str(other)]) == 2
    assert "was trained on base LlamaForCausalLM with frozen weights" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists() or not any((tmp_path / "wrong").iterdir())
    assert main(["merge", str(checkpoint), str(tmp_path / "merged"), "--merge-lora", "--base", str(base)]) == 0
    probe = torch.load(root / "two" / "probe.pt")
    merged = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        logits = merged(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    keep = probe["attention_mask"].bool()
    assert (logits[keep] - probe["logits"][keep]).abs().max().item() < 1e-5


def test_bf16_base_keeps_fp32_adapters(runs):
    root, _ = runs
    result = _result(root, "two_bf16")
    assert result["param_dtypes"] == {"trainable": ["torch.float32"], "frozen": ["torch.bfloat16"]}
    assert len(result["losses"]) == 2 and all(loss == loss for loss in result["losses"])  # trains, no NaN


def test_merge_of_a_bf16_base_run(runs, tmp_path):
    from shardtrain.cli.main import main

    root, _ = runs
    base = tmp_path / "base_bf16"
    tiny_llama().to(torch.bfloat16).save_pretrained(str(base))  # the base that run trained on
    out = tmp_path / "merged"
    assert main(["merge", str(root / "two_bf16" / "checkpoint-2"), str(out), "--merge-lora", "--base", str(base)]) == 0
    assert (out / "model.safetensors").is_file()


def test_missing_peft_is_one_clear_error(monkeypatch):
    import sys

    from shardtrain.errors import PeftError
    from shardtrain.train.model.lora import add_adapters

    monkeypatch.setitem(sys.modules, "peft", None)  # as if it were not installed
    with pytest.raises(PeftError, match=r"pip install 'shardtrain\[peft\]'"):
        add_adapters(tiny_llama(), object())
