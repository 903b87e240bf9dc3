"""The XLA backend's refusals and settings, checked without torch_xla (tests/xla runs the path itself)."""

import pytest

from shardtrain import TrainingArguments
from shardtrain.config.run_spec import RunSpec
from shardtrain.errors import FSDPConfigError
from shardtrain.parallel.backend import TrainingBackend
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.runtime import make_backend
from shardtrain.parallel.xla import XlaBackend


def _args(tmp_path, fsdp_config=None, **kwargs):
    return TrainingArguments(output_dir=str(tmp_path), fsdp=True,
                             fsdp_config={"xla": True, "xla_fsdp_v2": True, **(fsdp_config or {})}, **kwargs)


def _check(args, model=None, **sizes):
    world = 1
    for size in sizes.values():
        world *= size
    dims = ParallelDims.resolve(world_size=world, **sizes)
    XlaBackend(RunSpec.resolve(args)).check(model, dims)


def test_backend_follows_fsdp_config(tmp_path):
    assert type(make_backend(RunSpec.resolve(_args(tmp_path)))) is XlaBackend
    plain = RunSpec.resolve(TrainingArguments(output_dir=str(tmp_path), fsdp=True))
    assert type(make_backend(plain)) is TrainingBackend and make_backend(plain).name == "fsdp2"


@pytest.mark.parametrize(("fsdp_config", "kwargs", "sizes", "message"), [
    ({"cpu_offload": True}, {}, {}, "does not support fsdp_config 'cpu_offload'"),
    ({"activation_checkpointing": True}, {}, {}, "use 'xla_fsdp_grad_ckpt': true"),
    ({}, {"torch_compile": True}, {}, "torch_compile = True"),
    ({}, {"bf16": True}, {}, "bf16 = True"),
    ({}, {"save_async": True}, {}, "save_async = True"),
    ({}, {}, {"dp_shard": 2, "tp": 2}, "tp_size = 2"),
    ({}, {}, {"dp_shard": 1, "pp": 2}, "pp_size = 2"),
])
def test_unsupported_settings_are_refused_with_the_fix(tmp_path, fsdp_config, kwargs, sizes, message):
    with pytest.raises(FSDPConfigError, match=message) as err:
        _check(_args(tmp_path, fsdp_config, **kwargs), **sizes)
    assert "or set 'xla': false to train with FSDP2" in str(err.value)


def test_a_model_path_is_refused(tmp_path):
    with pytest.raises(FSDPConfigError, match="needs a model object: load it first"):
        _check(_args(tmp_path), model=str(tmp_path))


def test_supported_settings_pass(tmp_path):
    _check(_args(tmp_path, {"xla_fsdp_grad_ckpt": True, "state_dict_type": "SHARDED_STATE_DICT"}))
