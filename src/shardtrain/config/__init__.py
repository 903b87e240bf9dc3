"""Configuration: fsdp_config parsing and launch configs."""

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import FSDPConfigError

__all__ = ["FSDPConfig", "FSDPConfigError"]
