"""TPU path: PyTorch/XLA behind the `TrainingBackend` seam, chosen by `fsdp_config` `"xla": true`.

    args = TrainingArguments(..., fsdp=True, fsdp_config={"xla": True, "xla_fsdp_v2": True})
    Trainer(model, args, train_dataset=ds).train()      # run with plain `python`, one process per host

Two wrappers, as Hugging Face's Trainer offers them:
- `xla_fsdp_v2: true` (SPMD, `SpmdFullyShardedDataParallel`): one process drives every local device through a
  ("fsdp", "tensor") mesh of (devices, 1). Parameters are sharded on the fsdp axis, each batch is sharded on
  its first dimension and so are the logits. `per_device_train_batch_size` keeps its meaning: the process
  loads `per_device_train_batch_size x devices` samples per micro-step (Hugging Face's Trainer loads only
  `per_device_train_batch_size` in all under SPMD; ours gives the same global batch as FSDP2 on as many ranks).
  SPMD is switched on here (`xr.use_spmd()`), the user need not set `XLA_USE_SPMD`.
- otherwise `XlaFullyShardedDataParallel` (v1) with `xla_fsdp_settings` passed through (dtype names such as
  "bfloat16" become dtypes). Tested on one device only: multi-device v1 on XLA:CPU does not meet at its
  collectives without patching torch_xla, so multi-device v1 is unverified here.

Both take their units from the same wrap policy as FSDP2 (`find_fsdp_units`: layer classes, or size) and
`xla_fsdp_grad_ckpt` checkpoints each unit with torch_xla's `checkpoint_module`. Checkpoints go through
`shardtrain.parallel.xla_state.XlaStates`: the same DCP / safetensors layout as FSDP2, never torch_xla's
pickled `.pth` shards.
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.config.run_spec import RunSpec
from shardtrain.errors import FSDPConfigError
from shardtrain.parallel.backend import TrainingBackend
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.fsdp import find_fsdp_units
from shardtrain.parallel.layout import Layout
from shardtrain.parallel.xla_state import XlaStates, register_xla_rng

_DTYPE_KEYS = ("compute_dtype", "buffer_dtype")
_V2_SETTINGS = frozenset({"extra_data_axis"})  # what SpmdFullyShardedDataParallel takes beyond mesh and wrapping


def xla_settings(config: FSDPConfig) -> dict[str, Any]:
    """`xla_fsdp_settings` as the wrapper takes them: dtype names ("bfloat16", "torch.float32") become dtypes.

    Raises:
        FSDPConfigError: an unknown dtype name, or a v1-only setting with `xla_fsdp_v2`.
    """
    settings = dict(config.xla_fsdp_settings)
    for key in _DTYPE_KEYS:
        value = settings.get(key)
        if isinstance(value, str):
            dtype = getattr(torch, value.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise FSDPConfigError(f"fsdp_config 'xla_fsdp_settings' key {key!r} got {value!r}, which is not a "
                                      f"torch dtype; use e.g. 'bfloat16' or 'float32'")
            settings[key] = dtype
    if config.xla_fsdp_v2:
        unknown = sorted(set(settings) - _V2_SETTINGS)
        if unknown:
            raise FSDPConfigError(f"fsdp_config 'xla_fsdp_settings' has {unknown}, which SPMD FSDPv2 "
                                  f"(xla_fsdp_v2: true) does not take; it accepts {sorted(_V2_SETTINGS)}. "
                                  "Remove them, or set 'xla_fsdp_v2': false for the v1 wrapper")
    return settings


def shard_output(output: Any, mesh: Any) -> None:
    """Shard a unit's output on its batch dimension over the fsdp axis: a tensor, the first tensor of a
    tuple, or a model output's logits (what the compiler needs to keep the computation data-parallel)."""
    import torch_xla.distributed.spmd as xs

    tensor = None
    if isinstance(output, torch.Tensor):
        tensor = output
    elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        tensor = output[0]
    elif getattr(output, "logits", None) is not None:
        tensor = output.logits
    if tensor is not None and tensor.dim() > 0:
        xs.mark_sharding(tensor, mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))


class XlaBackend(TrainingBackend):
    """PyTorch/XLA FSDP: SPMD v2 (one process, every local device) or the v1 wrapper (one device)."""

    name = "xla"
    state_access = XlaStates
    host_device_type = "cpu"  # host-side process group (barriers, agreement on errors): gloo

    def __init__(self, spec: RunSpec) -> None:
        super().__init__(spec)
        self.config: FSDPConfig = spec.fsdp
        self.spmd = bool(self.config.xla_fsdp_v2)
        self.mesh = None

    def setup(self) -> None:
        if importlib.util.find_spec("torch_xla") is None:
            raise FSDPConfigError("fsdp_config sets 'xla': true but torch_xla is not installed; install torch_xla "
                                  "(bash scripts/setup_xla.sh makes a venv with it), or set 'xla': false to use "
                                  "FSDP2 on CPU/GPU")
        processes = self.spec.world_size
        if processes > 1:
            raise FSDPConfigError(
                f"fsdp_config 'xla': true runs as one process, but WORLD_SIZE is {processes}: SPMD "
                "(xla_fsdp_v2: true) drives every local device from one process. Start it with plain python "
                "(or shardtrain launch --nproc_per_node 1)")
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self.spmd:
            xr.use_spmd()  # before the first XLA tensor
        super().setup()  # a one-process gloo group for the host side
        self.device = torch_xla.device()
        xm.set_rng_state(self.spec.seed)
        register_xla_rng()
        if self.spmd:
            import torch_xla.distributed.spmd as xs

            count = xr.global_runtime_device_count()
            self.devices_per_process = count
            self.mesh = xs.Mesh(np.arange(count), (count, 1), ("fsdp", "tensor"))
            xs.set_global_mesh(self.mesh)

    def check(self, model: Any, dims: ParallelDims) -> None:
        """Refuse what the XLA path does not do, naming the setting and the fix (before the model is touched)."""
        if isinstance(model, str | os.PathLike):
            raise FSDPConfigError("fsdp_config 'xla': true needs a model object: load it first (e.g. "
                                  "AutoModelForCausalLM.from_pretrained(path)) and pass it to the Trainer")
        spec = self.spec
        problems = [f"{name} = {size}" for name, size in (("tp_size", dims.tp), ("cp_size", dims.cp),
                                                         ("ep_size", dims.ep), ("pp_size", dims.pp)) if size > 1]
        if spec.compile_options is not None:
            problems.append("torch_compile = True (XLA compiles every step's graph itself)")
        if self.config.cpu_offload:
            problems.append("fsdp_config 'cpu_offload'")
        if self.config.activation_checkpointing:
            problems.append("fsdp_config 'activation_checkpointing' (use 'xla_fsdp_grad_ckpt': true)")
        if spec.save_async:
            problems.append("save_async = True")
        if spec.mixed_precision != "no":
            problems.append(f"{spec.mixed_precision} = True (v1: set xla_fsdp_settings compute_dtype)")
        if problems:
            raise FSDPConfigError(f"fsdp_config 'xla': true does not support {', '.join(problems)}; remove it, "
                                  "or set 'xla': false to train with FSDP2")

    def parallelize(self, model: nn.Module, layout: Layout, *, adapters: bool = False) -> nn.Module:
        if adapters:
            raise FSDPConfigError("fsdp_config 'xla': true with LoRA adapters is not supported yet; train "
                                  "adapters with FSDP2 ('xla': false)")
        settings = xla_settings(self.config)
        units = {id(m) for m in find_fsdp_units(model, self.config)}
        if self.config.xla_fsdp_grad_ckpt and not units:
            raise FSDPConfigError("fsdp_config 'xla_fsdp_grad_ckpt': true checkpoints each wrapped unit, but the "
                                  f"wrap policy {self.config.auto_wrap_policy!r} makes none; set "
                                  "'transformer_layer_cls_to_wrap' (or auto_wrap_policy TRANSFORMER_BASED_WRAP)")
        from torch_xla.distributed.fsdp import checkpoint_module
        from torch_xla.distributed.fsdp.wrap import lambda_auto_wrap_policy

        if self.spmd:
            from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as Wrap

            settings = {**settings, "mesh": self.mesh, "shard_output": shard_output}
        else:
            from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as Wrap

        config = getattr(model, "config", None)
        if self.config.xla_fsdp_grad_ckpt and getattr(config, "use_cache", False):
            # a recomputed layer would append its keys and values to the forward's KV cache a second time
            # (transformers' own checkpointing turns the cache off the same way)
            config.use_cache = False
        policy = partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units) if units else None
        wrapper = (lambda m, *a, **k: Wrap(checkpoint_module(m), *a, **k)) if self.config.xla_fsdp_grad_ckpt \
            else None
        return Wrap(model.to(self.device), auto_wrap_policy=policy, auto_wrapper_callable=wrapper, **settings)

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if self.spmd:
            import torch_xla.distributed.spmd as xs

            for tensor in out.values():  # samples over the fsdp axis, as torch_xla's MpDeviceLoader would
                if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and \
                        tensor.shape[0] % self.devices_per_process == 0:
                    xs.mark_sharding(tensor, self.mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))
        return out

    def all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        """One process holds every device's values (SPMD) or the only device (v1): nothing to add."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """One process: its value is everyone's."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def is_sharded(self, model: nn.Module) -> bool:
        return False  # one process: the gradients are the global batch's already

    def step_end(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.mark_step()
