"""fsdp_config parsing: defaults, Accelerate spellings, legacy strategies, and errors that name the key."""

import json

import pytest

from shardtrain import FSDPConfig, FSDPConfigError
from shardtrain.config.fsdp_config import parse_fsdp_option


def test_defaults():
    config = FSDPConfig.load(None)
    assert (config.version, config.reshard_after_forward, config.cpu_offload) == (2, True, False)
    assert config.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and config.state_dict_type == "FULL_STATE_DICT"
    assert config.transformer_layer_cls_to_wrap == [] and not config.activation_checkpointing


def test_seed_example_json_file(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({
        "version": 2, "reshard_after_forward": True, "cpu_offload": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "FULL_STATE_DICT",
        "cpu_ram_efficient_loading": True, "activation_checkpointing": True}))
    config = FSDPConfig.load(str(path))
    assert config.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert config.cpu_ram_efficient_loading and config.activation_checkpointing
    assert FSDPConfig.load(config) == config and FSDPConfig.load(config) is not config
    assert FSDPConfig.load(config.to_dict()) == config


def test_prefix_stripping_aliases_and_comma_string():
    config = FSDPConfig.load({"fsdp_offload_params": True, "fsdp_transformer_layer_cls_to_wrap": "BertLayer, Foo",
                              "fsdp_state_dict_type": "sharded_state_dict", "fsdp_version": 2})
    assert config.cpu_offload and config.transformer_layer_cls_to_wrap == ["BertLayer", "Foo"]
    assert config.state_dict_type == "SHARDED_STATE_DICT"


@pytest.mark.parametrize("value,reshard,replicate,hybrid", [
    ("full_shard", True, False, False), (1, True, False, False), ("shard_grad_op", False, False, False),
    (2, False, False, False), ("no_shard", False, True, False), (3, False, True, False),
    ("hybrid_shard", True, False, True), (4, True, False, True), ("HYBRID_SHARD_ZERO2", False, False, True),
    (5, False, False, True), ("1", True, False, False)])
def test_legacy_strategies(value, reshard, replicate, hybrid):
    config = FSDPConfig.load({"fsdp_sharding_strategy": value})
    assert (config.reshard_after_forward, config.replicate_only, config.hybrid) == (reshard, replicate, hybrid)


def test_fsdp_option_strings():
    assert parse_fsdp_option(True) == (True, {})
    assert parse_fsdp_option(False) == (False, {})
    assert parse_fsdp_option("full shard") == (True, {"sharding_strategy": "full_shard"})
    assert parse_fsdp_option("shard_grad_op auto_wrap offload") == (
        True, {"sharding_strategy": "shard_grad_op", "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "cpu_offload": True})
    with pytest.raises(FSDPConfigError, match="unknown option 'fulll_shard'"):
        parse_fsdp_option("fulll_shard")


@pytest.mark.parametrize("raw,fragments", [
    ({"version": 1}, ["'version'", "FSDP1", "'version': 2"]),
    ({"version": 3}, ["'version'", "3"]),
    ({"reshard_after_forwad": True}, ["reshard_after_forwad", "did you mean 'reshard_after_forward'"]),
    ({"fsdp_cpu_offlaod": True}, ["fsdp_cpu_offlaod", "did you mean 'cpu_offload'"]),
    ({"cpu_offload": "yes"}, ["'cpu_offload'", "'yes'", "true or false"]),
    ({"reshard_after_forward": 0.5}, ["'reshard_after_forward'", "0.5"]),
    ({"auto_wrap_policy": "LAYER_WRAP"}, ["'auto_wrap_policy'", "LAYER_WRAP", "SIZE_BASED_WRAP"]),
    ({"state_dict_type": "LOCAL"}, ["'state_dict_type'", "LOCAL", "SHARDED_STATE_DICT"]),
    ({"min_num_params": -1}, ["'min_num_params'", "-1"]),
    ({"min_num_params": "many"}, ["'min_num_params'", "many"]),
    ({"transformer_layer_cls_to_wrap": 5}, ["'transformer_layer_cls_to_wrap'", "5"]),
    ({"sharding_strategy": "half_shard"}, ["'sharding_strategy'", "half_shard", "full_shard"]),
    ({"sharding_strategy": 7}, ["'sharding_strategy'", "7"]),
    ({"mixed_precision": "fp8"}, ["'mixed_precision'", "fp8"]),
    ({"xla_fsdp_grad_ckpt": True}, ["'xla'", "xla_fsdp_grad_ckpt"]),
    ({"xla_fsdp_settings": [1]}, ["'xla_fsdp_settings'"]),
    ({"sharding_strategy": "full_shard", "reshard_after_forward": False}, ["'reshard_after_forward'", "full_shard"]),
    ({"dp_shard_size": 0}, ["'dp_shard_size'", "0"]),
])
def test_errors_name_the_key(raw, fragments):
    with pytest.raises(FSDPConfigError) as err:
        FSDPConfig.load(raw)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_file_errors(tmp_path):
    with pytest.raises(FSDPConfigError, match="does not exist"):
        FSDPConfig.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FSDPConfigError, match="not valid JSON"):
        FSDPConfig.load(str(bad))
    with pytest.raises(FSDPConfigError, match="must be a dict"):
        FSDPConfig.load(42)


def test_fsdp1_only_keys_warn_and_are_ignored():
    with pytest.warns(UserWarning, match="fsdp_backward_prefetch_policy"):
        config = FSDPConfig.load({"fsdp_backward_prefetch_policy": "BACKWARD_PRE", "fsdp_use_orig_params": True})
    assert config == FSDPConfig()


def test_xla_without_torch_xla_is_a_clear_error(tmp_path):
    from shardtrain import TrainingArguments
    from shardtrain.config.run_spec import RunSpec
    from shardtrain.parallel.runtime import make_backend

    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config={"xla": True, "xla_fsdp_v2": True})
    backend = make_backend(RunSpec.resolve(args))
    assert backend.name == "xla"
    with pytest.raises(FSDPConfigError, match="torch_xla is not installed.*setup_xla.sh"):
        backend.setup()


def test_fsdp_config_as_json_text_as_hugging_face_takes_it():
    assert FSDPConfig.load('{"xla": true, "xla_fsdp_v2": true}') == FSDPConfig.load({"xla": True, "xla_fsdp_v2": True})
    with pytest.raises(FSDPConfigError, match="not valid JSON"):
        FSDPConfig.load('{"xla": tru}')


@pytest.mark.parametrize(("settings", "v2", "expected"), [
    ({"compute_dtype": "bfloat16", "buffer_dtype": "torch.float32", "flatten_parameters": True}, False,
     {"compute_dtype": "torch.bfloat16", "buffer_dtype": "torch.float32", "flatten_parameters": "True"}),
    ({"extra_data_axis": "data"}, True, {"extra_data_axis": "data"}),
])
def test_xla_settings_are_converted_for_the_wrapper(settings, v2, expected):
    from shardtrain.parallel.xla import xla_settings

    config = FSDPConfig.load({"xla": True, "xla_fsdp_v2": v2, "xla_fsdp_settings": settings})
    assert {k: str(v) for k, v in xla_settings(config).items()} == expected


@pytest.mark.parametrize(("settings", "v2", "message"), [
    ({"compute_dtype": "bfloat17"}, False, "'compute_dtype' got 'bfloat17', which is not a torch dtype"),
    ({"flatten_parameters": True}, True, r"\['flatten_parameters'\], which SPMD FSDPv2"),
])
def test_bad_xla_settings_name_the_key(settings, v2, message):
    from shardtrain.parallel.xla import xla_settings

    with pytest.raises(FSDPConfigError, match=message):
        xla_settings(FSDPConfig.load({"xla": True, "xla_fsdp_v2": v2, "xla_fsdp_settings": settings}))


def test_layout_keys():
    config = FSDPConfig.load({"layout": "AUTO", "max_memory_per_rank": "2GiB", "activation_checkpointing": True})
    assert (config.layout, config.max_memory_per_rank) == ("auto", 2 * 2**30)
    assert config.given == {"layout", "max_memory_per_rank", "activation_checkpointing"}
    assert FSDPConfig.load(config.to_dict()).max_memory_per_rank == 2 * 2**30  # the saved form loads again
    assert FSDPConfig.load({"layout": "manual"}).layout is None


@pytest.mark.parametrize("raw,message", [
    ({"layout": "fastest"}, "'layout' got 'fastest'; allowed values: \"auto\""),
    ({"max_memory_per_rank": "8GiB"}, "'max_memory_per_rank' without 'layout': \"auto\""),
    ({"layout": "auto", "max_memory_per_rank": "lots"}, "max_memory_per_rank' = 'lots' is not a memory size"),
    ({"layout": "auto", "xla": True}, "'layout': \"auto\" with 'xla': true"),
])
def test_layout_errors(raw, message):
    with pytest.raises(FSDPConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FSDPConfig.load(raw)
