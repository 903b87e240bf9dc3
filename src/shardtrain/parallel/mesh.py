"""Data-parallel device meshes: 1-D (shard) for full/zero2 sharding, 2-D (replicate, shard) for HSDP."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtrain.config.fsdp_config import FSDPConfig, FSDPConfigError
from shardtrain.parallel.distributed import current_device


def dp_mesh_shape(config: FSDPConfig, world_size: int) -> tuple[int, int]:
    """(replicate, shard) sizes for `config` on `world_size` ranks.

    no_shard -> (N, 1); hybrid -> (N / shard, shard) with shard = `dp_shard_size` or LOCAL_WORLD_SIZE
    (one node shards, nodes replicate); otherwise (1, N).
    """
    if config.replicate_only:
        return world_size, 1
    if config.hybrid:
        shard = config.dp_shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if shard < 1 or world_size % shard:
            raise FSDPConfigError(f"fsdp_config hybrid sharding needs 'dp_shard_size' ({shard}) to divide the world "
                                  f"size ({world_size}); set 'dp_shard_size' to a divisor of {world_size}")
        return world_size // shard, shard
    if config.dp_shard_size not in (None, world_size):
        raise FSDPConfigError(f"fsdp_config 'dp_shard_size' = {config.dp_shard_size} only applies to hybrid_shard; "
                              f"use 'sharding_strategy': 'hybrid_shard' or drop it")
    return 1, world_size


def build_dp_mesh(config: FSDPConfig, world_size: int | None = None) -> DeviceMesh:
    """The data-parallel mesh FSDP2 shards over (names: dp_shard, or dp_replicate x dp_shard)."""
    world_size = world_size or dist.get_world_size()
    replicate, shard = dp_mesh_shape(config, world_size)
    device = current_device().type
    if replicate == 1:
        return init_device_mesh(device, (shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
