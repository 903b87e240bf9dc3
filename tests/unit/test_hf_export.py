"""The file plans of the sharded save_model: output files as save_pretrained splits, staging files, owners."""

from shardtrain.checkpoint.full import SINGLE_FILE, plan_weight_files
from shardtrain.checkpoint.hf_export import STAGING_BYTES, STAGING_FILES, owned_files, staging_groups

MIB = 1024**2


def test_one_file_up_to_the_limit_then_files_in_order():
    sizes = {f"w{i}": 10 for i in range(5)}
    assert set(plan_weight_files(sizes, max_shard_bytes=50).values()) == {SINGLE_FILE}
    plan = plan_weight_files(sizes, max_shard_bytes=25)
    assert plan == {"w0": "model-00001-of-00003.safetensors", "w1": "model-00001-of-00003.safetensors",
                    "w2": "model-00002-of-00003.safetensors", "w3": "model-00002-of-00003.safetensors",
                    "w4": "model-00003-of-00003.safetensors"}
    # a tensor above the limit gets a file of its own, as in save_pretrained
    assert plan_weight_files({"big": 100, "small": 1}, max_shard_bytes=25) == {
        "big": "model-00001-of-00002.safetensors", "small": "model-00002-of-00002.safetensors"}


def test_staging_files_stay_small_and_inside_one_output_file():
    sizes = {f"w{i}": 100 * MIB for i in range(12)} | {"huge": 600 * MIB}
    weight_map = plan_weight_files(sizes, max_shard_bytes=1000 * MIB)
    groups = staging_groups(sizes, weight_map, world_size=4)
    assert sorted(set(groups.values())) == list(range(1, max(groups.values()) + 1))
    by_group: dict[int, list[str]] = {}
    for key, index in groups.items():
        by_group.setdefault(index, []).append(key)
    for keys in by_group.values():
        assert len({weight_map[key] for key in keys}) == 1
        assert sum(sizes[key] for key in keys) <= STAGING_BYTES or len(keys) == 1
    assert groups["huge"] not in {groups[f"w{i}"] for i in range(12)}


def test_staging_files_grow_on_many_ranks_to_bound_open_files():
    sizes = {f"w{i}": 64 * MIB for i in range(256)}  # 16 GiB
    weight_map = plan_weight_files(sizes, max_shard_bytes=5 * 1024 * MIB)
    for world in (1, 8, 64, 256):
        groups = staging_groups(sizes, weight_map, world)
        outputs = len(set(weight_map.values()))
        assert max(groups.values()) * world <= STAGING_FILES + (outputs + 1) * world


def test_every_output_file_has_one_owner():
    weight_map = {f"w{i}": f"model-{i + 1:05d}-of-00005.safetensors" for i in range(5)}
    owners = [owned_files(weight_map, rank, 2) for rank in range(2)]
    assert owners[0] == ["model-00001-of-00005.safetensors", "model-00003-of-00005.safetensors",
                         "model-00005-of-00005.safetensors"]
    assert sorted(owners[0] + owners[1]) == sorted(set(weight_map.values()))
    assert owned_files({"w": SINGLE_FILE}, 0, 4) == [SINGLE_FILE] and owned_files({"w": SINGLE_FILE}, 3, 4) == []
