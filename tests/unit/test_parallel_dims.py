"""ParallelDims: sizes resolved from every source, and each impossible layout refused with the sizes named."""

import json

import pytest
from accelerate.parallelism_config import ParallelismConfig

from shardtrain import FSDPConfig, TrainingArguments
from shardtrain.config.parallelism import read_parallelism
from shardtrain.errors import ParallelDimsError, ParallelismError, TrainingArgumentsError
from shardtrain.parallel.dims import ParallelDims


def sizes(dims: ParallelDims) -> tuple[int, ...]:
    return dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp


@pytest.mark.parametrize("kwargs,expected", [
    ({}, (1, 8, 1, 1)),
    ({"cp": 2}, (1, 4, 2, 1)),
    ({"cp": 2, "dp_shard": 2}, (2, 2, 2, 1)),
    ({"dp_replicate": 2}, (2, 4, 1, 1)),
    ({"cp": 4, "dp_replicate": 2}, (2, 1, 4, 1)),
    ({"fsdp_config": FSDPConfig.load({"sharding_strategy": "no_shard"})}, (8, 1, 1, 1)),
    ({"fsdp_config": FSDPConfig.load({"sharding_strategy": "hybrid_shard"}), "local_world_size": 4}, (2, 4, 1, 1)),
    ({"fsdp_config": FSDPConfig.load({"sharding_strategy": "hybrid_shard"}), "local_world_size": 4, "cp": 2},
     (2, 2, 2, 1)),
    ({"fsdp_config": FSDPConfig.load({"sharding_strategy": "hybrid_shard", "dp_shard_size": 2})}, (4, 2, 1, 1)),
    # dp_shard_size without hybrid: the plain shard size when cp takes the rest of the ranks
    ({"fsdp_config": FSDPConfig.load({"dp_shard_size": 4}), "cp": 2}, (1, 4, 2, 1)),
])
def test_sizes_are_filled_in(kwargs, expected):
    dims = ParallelDims.resolve(world_size=8, **kwargs)
    assert sizes(dims) == expected
    assert dims.batch_size == expected[0] * expected[1]
    assert dims.grad_average_size == expected[0] * expected[1] * expected[2]


def test_rank_coordinates_put_cp_ranks_next_to_each_other():
    dims = ParallelDims.resolve(world_size=8, cp=2, dp_replicate=2)
    coords = [dims.rank_coords(r) for r in range(8)]
    assert [c["cp"] for c in coords] == [0, 1] * 4
    assert [c["batch"] for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [c["dp_replicate"] for c in coords] == [0] * 4 + [1] * 4


@pytest.mark.parametrize("kwargs,words", [
    ({"cp": 3}, ["cp_size x tp_size = 3 x 1 = 3 does not divide the 8 ranks"]),
    ({"dp_shard": 3}, ["dp_shard 3", "8 ranks", "dp_shard_size=3"]),
    ({"dp_shard": 4, "dp_replicate": 4}, ["dp_replicate 4 x dp_shard 4", "8 ranks"]),
    ({"fsdp_config": FSDPConfig.load({"dp_shard_size": 4})}, ["dp_shard 4", "hybrid_shard"]),
    ({"cp": 0}, ["cp_size = 0", ">= 1"]),
    ({"ep": 3}, ["ep_size = 3", "divide"]),
])
def test_impossible_layouts_are_refused_naming_the_sizes(kwargs, words):
    with pytest.raises(ParallelDimsError) as info:
        ParallelDims.resolve(world_size=8, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_parallelism_config_from_accelerate_object_dict_and_prefixed_keys():
    assert read_parallelism(ParallelismConfig(cp_size=2), "x") == ({"cp_size": 2}, [])
    got, ignored = read_parallelism({"parallelism_config_dp_shard_size": "2", "cp_size": 2, "cp_backend": "torch"}, "x")
    assert got == {"dp_shard_size": 2, "cp_size": 2} and ignored == ["x.cp_backend"]
    for bad, word in (({"cp_sise": 2}, "did you mean 'cp_size'"), ({"sp_size": 2}, "Ulysses"),
                      ({"cp_comm_strategy": "alltoall"}, "allgather"), ({"tp_size": 0}, "int >= 1")):
        with pytest.raises(ParallelismError, match=word):
            read_parallelism(bad, "x")


def test_script_sizes_win_over_the_launcher_key_by_key(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDTRAIN_PARALLELISM", json.dumps({"cp_size": 4, "dp_shard_size": 2}))
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, parallelism_config=ParallelismConfig(cp_size=2))
    assert args.parallel_sizes == {"cp_size": 2, "dp_shard_size": 2} and args.cp_size == 2
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True)
    assert args.parallel_sizes == {"cp_size": 4, "dp_shard_size": 2} and args.cp_size == 4
    json.loads(args.to_json_string())
    with pytest.raises(TrainingArgumentsError, match="cp_size = 2 but parallelism_config.cp_size = 4"):
        TrainingArguments(output_dir=str(tmp_path), fsdp=True, cp_size=2, parallelism_config={"cp_size": 4})


def test_pipeline_size_comes_the_three_ways_in(monkeypatch, tmp_path):
    from shardtrain.config.launch_config import LaunchConfig
    from shardtrain.config.run_spec import RunSpec

    script = TrainingArguments(output_dir=str(tmp_path), fsdp=True, pp_size=2, pp_schedule="GPipe", pp_microbatches=4)
    spec = RunSpec.resolve(script)
    assert (script.parallel_sizes, spec.sizes["pp"], spec.pp_schedule, spec.pp_microbatches) == \
        ({"pp_size": 2}, 2, "GPipe", 4)
    assert TrainingArguments(output_dir=str(tmp_path), fsdp=True,
                             parallelism_config={"parallelism_config_pp_size": 2}).pp_size == 2
    config = LaunchConfig.from_dict({"parallelism_config": {"parallelism_config_pp_size": 2}}, "config.yaml")
    assert config.use_parallelism_config and config.parallelism == {"pp_size": 2}
    monkeypatch.setenv("SHARDTRAIN_PARALLELISM", json.dumps({"pp_size": 2}))  # what the launcher hands the ranks
    assert TrainingArguments(output_dir=str(tmp_path), fsdp=True).pp_size == 2
