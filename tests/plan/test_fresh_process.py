"""`plan.fresh_process`: what rank 0 hands the child that traces "auto" when the process group is already up —
the model as JSON, rebuilt on the meta device with the same parameters (the 2-rank run that traces there:
tests/distributed/test_auto_layout_run.py; TRL's SFTTrainer: tests/distributed/test_trl.py)."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_gpt2, tiny_llama

from shardtrain.errors import FSDPConfigError
from shardtrain.plan.fresh_process import describe, rebuild


def shapes(model: torch.nn.Module) -> dict:
    return {name: (tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()}


@pytest.mark.parametrize("make", [lambda: tiny_gpt2(), lambda: tiny_llama(tie=True).to(torch.bfloat16)],
                         ids=["gpt2", "llama_tied_bf16"])
def test_rebuilt_model_has_the_same_parameters(make, tmp_path):
    live = make()
    described = json.loads(json.dumps(describe(live, tmp_path / "adapter")))  # plain JSON, nothing pickled
    rebuilt = rebuild(described)
    assert all(p.device.type == "meta" for p in rebuilt.parameters())
    assert shapes(rebuilt) == shapes(live)
    assert rebuilt.config.tie_word_embeddings == live.config.tie_word_embeddings
    assert rebuilt.config._attn_implementation == live.config._attn_implementation


def test_peft_model_is_rebuilt_with_its_adapters(tmp_path):
    live = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.1, task_type="CAUSAL_LM"))
    described = describe(live, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    rebuilt = rebuild(json.loads(json.dumps(described)))
    assert shapes(rebuilt) == shapes(live)  # the adapters trainable, the base frozen, as in the live model
    assert sum(p.requires_grad for p in rebuilt.parameters()) == 8  # A and B of q and v in 2 layers


def test_a_plain_module_is_refused_with_the_fix(tmp_path):
    with pytest.raises(FSDPConfigError, match=r"this model \(Sequential\) is not a transformers PreTrainedModel.*"
                                              r"create the Trainer before the process group starts"):
        describe(torch.nn.Sequential(torch.nn.Linear(2, 2)), tmp_path)


def test_a_class_from_the_script_being_run_is_refused(tmp_path):
    model = tiny_llama()
    script_class = type("MyLlama", (type(model),), {"__module__": "__main__"})
    model.__class__ = script_class
    with pytest.raises(FSDPConfigError, match="cannot import MyLlama: it is defined in the script being run; move it "
                                              "into a module"):
        describe(model, tmp_path)
