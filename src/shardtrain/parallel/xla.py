"""TPU path: FSDP through PyTorch/XLA, used when `fsdp_config` sets `xla: true`."""

from __future__ import annotations

import importlib.util

from torch import nn

from shardtrain.config.fsdp_config import FSDPConfig, FSDPConfigError


def apply_xla_fsdp(model: nn.Module, config: FSDPConfig) -> nn.Module:
    """Wrap `model` with PyTorch/XLA's FSDP (v1 wrapper, or SPMD FSDPv2 when `xla_fsdp_v2`).

    Raises:
        FSDPConfigError: torch_xla is not installed.
    """
    if importlib.util.find_spec("torch_xla") is None:
        raise FSDPConfigError("fsdp_config sets 'xla': true but torch_xla is not installed; install "
                              "torch_xla on a TPU host, or set 'xla': false to use FSDP2 on CPU/GPU")
    if config.xla_fsdp_v2:  # pragma: no cover - needs a TPU
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        num_devices = xr.global_runtime_device_count()
        mesh = xs.Mesh(list(range(num_devices)), (num_devices, 1), ("fsdp", "tensor"))
        xs.set_global_mesh(mesh)
        return SpmdFullyShardedDataParallel(model, **config.xla_fsdp_settings)
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel  # pragma: no cover

    return XlaFullyShardedDataParallel(model, **config.xla_fsdp_settings)  # pragma: no cover
