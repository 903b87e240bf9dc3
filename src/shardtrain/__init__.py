"""shardtrain: FSDP2 training inside a Trainer."""

from shardtrain.config.fsdp_config import FSDPConfig, FSDPConfigError
from shardtrain.parallel.distributed import destroy_distributed, init_distributed
from shardtrain.parallel.fsdp import apply_fsdp

__version__ = "0.1.0"

__all__ = ["FSDPConfig", "FSDPConfigError", "apply_fsdp", "destroy_distributed", "init_distributed"]
