"""Which modules become FSDP units, decided on one process without any sharding."""

import pytest
from tiny_models import tiny_llama
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtrain import FSDPConfig, FSDPConfigError
from shardtrain.model_facts import tied_parameter_ids
from shardtrain.parallel.fsdp import find_fsdp_units, output_unit


def test_transformer_wrap_falls_back_to_no_split_modules():
    model = tiny_llama(layers=3)
    units = find_fsdp_units(model, FSDPConfig.load({}))
    assert [type(u) for u in units] == [LlamaDecoderLayer] * 3


def test_unknown_layer_class_lists_model_classes():
    with pytest.raises(FSDPConfigError) as err:
        find_fsdp_units(tiny_llama(), FSDPConfig.load({"transformer_layer_cls_to_wrap": "LlamaDecoderLayr"}))
    message = str(err.value)
    assert "transformer_layer_cls_to_wrap" in message and "LlamaDecoderLayr" in message
    assert "LlamaDecoderLayer" in message and "LlamaRMSNorm" in message


def test_size_based_wrap_threshold():
    model = tiny_llama()
    units = find_fsdp_units(model, FSDPConfig.load({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000}))
    assert units and all(sum(p.numel() for p in u.parameters()) >= 2000 for u in units)
    assert model not in units
    none = find_fsdp_units(model, FSDPConfig.load({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10**9}))
    assert none == []


def test_no_wrap_has_no_units():
    assert find_fsdp_units(tiny_llama(), FSDPConfig.load({"auto_wrap_policy": "NO_WRAP"})) == []


def test_output_unit_is_norm_and_head_unless_tied():
    forced = FSDPConfig.load({"output_unit": True})
    model = tiny_llama()
    assert output_unit(model, [], tied_parameter_ids(model), forced) == [model.model.norm, model.lm_head]
    tied = tiny_llama(tie=True)
    assert output_unit(tied, [], tied_parameter_ids(tied), forced) == []
    # tied params never go to a size-based unit of their own (that would untie them)
    units = find_fsdp_units(tied, FSDPConfig.load({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 100}))
    assert tied.model.embed_tokens not in units and tied.lm_head not in units


@pytest.mark.parametrize("vocab,expected", [(64, False), (4096, True)])
def test_auto_output_unit_only_when_the_head_is_as_big_as_a_layer(vocab, expected):
    model = tiny_llama(vocab=vocab)  # a layer has 9,280 parameters; the head 32 * vocab + 32
    units = find_fsdp_units(model, FSDPConfig.load({}))
    head = output_unit(model, units, tied_parameter_ids(model), FSDPConfig.load({}))
    assert head == ([model.model.norm, model.lm_head] if expected else [])
    assert output_unit(model, units, set(), FSDPConfig.load({"output_unit": "false"})) == []
    assert output_unit(model, units, set(), FSDPConfig.load({"fsdp_output_unit": "true"})) == [model.model.norm,
                                                                                               model.lm_head]


def test_output_unit_rejects_other_values():
    with pytest.raises(FSDPConfigError, match='output_unit.*"auto", true or false'):
        FSDPConfig.load({"output_unit": "sometimes"})
