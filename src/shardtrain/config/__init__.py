"""Configuration: fsdp_config parsing and launch configs."""

from shardtrain.config.fsdp_config import FSDPConfig, FSDPConfigError

__all__ = ["FSDPConfig", "FSDPConfigError"]
