"""Parallelism applied from outside the model: meshes, FSDP2 units, loading."""

from shardtrain.parallel.distributed import destroy_distributed, init_distributed
from shardtrain.parallel.fsdp import apply_fsdp, find_fsdp_units, fsdp_modules
from shardtrain.parallel.mesh import build_dp_mesh

__all__ = ["apply_fsdp", "build_dp_mesh", "destroy_distributed", "find_fsdp_units", "fsdp_modules",
           "init_distributed"]
