"""`build_optimizer` (the Trainer's and the planner's) builds the groups transformers' own Trainer builds."""

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.step.optim import build_optimizer, check_given_optimizer, decay_parameter_names


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def test_groups_equal_transformers_create_optimizer(tmp_path):
    model = _tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, learning_rate=3e-4,
                                          use_cpu=True, report_to=[])
    theirs = transformers.Trainer(model=model, args=args).create_optimizer()
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    ours = build_optimizer(model, decay_names=decay_parameter_names(model), weight_decay=args.weight_decay,
                           cls=cls, kwargs=kwargs)
    assert type(ours) is type(theirs)
    names = {id(p): n for n, p in model.named_parameters()}

    def described(optimizer):
        return sorted((g["weight_decay"], g["lr"], sorted(names[id(p)] for p in g["params"]))
                      for g in optimizer.param_groups if g["params"])
    assert described(ours) == described(theirs)
    assert {n for n in decay_parameter_names(model) if "norm" in n or "bias" in n} == set()


def test_kwargs_groups_of_an_override_replace_the_default_ones():
    model = _tiny_llama()
    head = [model.lm_head.weight]
    optimizer = build_optimizer(model, decay_names=[], weight_decay=0.0, cls=torch.optim.SGD,
                                kwargs={"lr": 0.5, "params": [{"params": head}]})
    assert [g["params"] for g in optimizer.param_groups] == [head] and optimizer.param_groups[0]["lr"] == 0.5


def test_an_optimizer_over_other_parameters_is_refused_with_the_fix():
    model, other = _tiny_llama(), _tiny_llama()
    check_given_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TrainingArgumentsError, match="optimizer_cls_and_kwargs"):
        check_given_optimizer(model, torch.optim.SGD(other.parameters(), lr=0.1))
