"""The backend seam: what differs between FSDP2 (CPU/GPU, one process per device) and PyTorch/XLA (TPU).

The Trainer calls a `TrainingBackend` for everything that is not the same on both: starting the processes and
what rank / world size mean, wrapping the model, putting a batch on the device, collectives on host-visible
values, the optimizer step and the end of a step, and how checkpoints read the state. `TrainingBackend` itself is FSDP2,
the default; `XlaBackend` (`shardtrain.parallel.xla`) is chosen by `fsdp_config` `"xla": true`.

    backend = make_backend(spec)        # parallel.runtime; a RunSpec; before anything touches a device
    backend.setup()                     # process group / XLA runtime; then backend.rank, world_size, device
"""

from __future__ import annotations

import warnings
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardtrain.config.run_spec import RunSpec
from shardtrain.parallel import collectives
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.distributed import current_device, init_distributed, launched_alone
from shardtrain.parallel.layout import Layout, apply_layout
from shardtrain.parallel.loading import fill_from_rank0, has_meta_tensors, meta_source, read_from_source
from shardtrain.parallel.states import TorchStates

# where a model object's weights come from (`TrainingBackend._weight_source`; else a directory and its read plan)
IN_MODEL, RANK0 = "in_model", "rank0"


def autocast_forward(model: nn.Module, device_type: str) -> None:
    """The model's current forward under bf16 `torch.autocast`, its outputs back in fp32, as Accelerate prepares a
    model for transformers' Trainer at the start of `train()` / evaluation: after a library's own patches (TRL's
    fused LM head replaces `forward`), so its loss runs in bf16 as under transformers. Once per forward."""
    from accelerate.utils import convert_outputs_to_fp32

    if getattr(model.forward, "_under_autocast", False):
        return
    forward = model.forward.__func__ if hasattr(model.forward, "__func__") else model.forward
    wrapped = convert_outputs_to_fp32(torch.autocast(device_type, dtype=torch.bfloat16)(forward))
    wrapped._under_autocast = True
    model.forward = MethodType(wrapped, model) if hasattr(model.forward, "__func__") else wrapped


class TrainingBackend:
    """FSDP2 on torch.distributed: one process per device; the base class of every backend.

    Attributes (after `setup`):
        rank, world_size: this process and the number of processes.
        device: where the model and batches live.
        devices_per_process: how many devices one process feeds (its loader yields that many per-device
            batches at once); 1 except under XLA SPMD.
        state_access: the `TorchStates`-like class checkpoints use.
    """

    name = "fsdp2"
    devices_per_process = 1
    state_access: type = TorchStates

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")

    @property
    def host_device_type(self) -> str:
        """The device type of the process group for host-side agreement (meshes, barriers)."""
        return self.device.type

    def check(self, model: Any, dims: ParallelDims) -> None:
        """Refuse settings (and a `model`: a module, a path or None) this backend does not support under the
        `dims` layout, before the model is touched."""

    def setup(self) -> None:
        if self.spec.fsdp is None and launched_alone():
            # one process that shards nothing starts no process group, as transformers' Trainer on one process:
            # a script or a library's cleanup that asks dist.is_initialized() finds what it finds there
            self.device = current_device()
            return
        init_distributed(timeout_s=self.spec.ddp_timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = current_device()

    def parallelize(self, model: nn.Module, layout: Layout, *, adapters: bool = False) -> nn.Module:
        """Apply `layout` from outside (`apply_layout`: context parallel, tensor parallel, expert parallel, then
        activation checkpointing, compile and FSDP per unit), with the model's weights from where they are (every
        rank, rank 0, or each rank's shards of a directory). A model sharded before the Trainer (an `FSDPModule`)
        is kept as it is. `adapters`: the model carries LoRA adapters."""
        from shardtrain.errors import TrainingArgumentsError

        spec, dims = self.spec, layout.dims
        compile_options = spec.compile_options
        if spec.fsdp is None:
            model.to(self.device)
            if compile_options:  # no FSDP units: the whole model is one graph
                model.compile(**compile_options)
            if self.world_size > 1:
                raise TrainingArgumentsError(
                    f"Trainer runs on {self.world_size} ranks but fsdp is off; set TrainingArguments(fsdp=True) "
                    "(FSDP2 with sharding_strategy 'no_shard' is plain data parallelism)")
            return model
        if isinstance(model, FSDPModule):
            if compile_options or dims.ep > 1:
                raise TrainingArgumentsError(
                    "the model is already sharded (fully_shard applied before the Trainer), so torch_compile / "
                    "ep_size cannot be applied to it; pass the unsharded model and let the Trainer shard it")
            if layout.cp is not None:  # its sharding is kept; its attention is split all the same
                layout.cp.enable(model)
            return model
        source = self._weight_source(model, spec.fsdp.cpu_ram_efficient_loading)
        full_state = model.state_dict() if source == RANK0 and self.rank == 0 else {}  # the unsharded tensors
        # No model.to(device) first: each fully_shard moves its own unit's tensors to the mesh's device and
        # shards them there (tp / ep's distribute_tensor do the same), so a GPU holds one unit unsharded at a
        # time during setup, never the whole model
        apply_layout(model, layout)
        if isinstance(source, tuple):  # every rank reads its shards from the directory
            read_from_source(model, *source, self.device)
        elif source == RANK0:
            fill_from_rank0(model, full_state, self.device)
        return model

    def _weight_source(self, model: nn.Module, rank0_loading: bool) -> Any:
        """Where a model object's weights come from (collective): `IN_MODEL` (every rank holds them), `RANK0`
        (`cpu_ram_efficient_loading`: ranks > 0 built it on the meta device and take rank 0's weights), or
        (directory, read plan) when every rank built it on the meta device (`from_pretrained(PATH,
        device_map="meta")`): each rank reads its shards from that directory. A model loaded in full on every
        rank under `cpu_ram_efficient_loading` is kept, with a warning."""
        from shardtrain.errors import TrainingArgumentsError

        on_meta = has_meta_tensors(model)
        flags = [torch.tensor(float(on_meta))] if self.world_size == 1 else \
            self.all_gather(torch.tensor([float(on_meta)], device=self.device))
        if all(flag.item() for flag in flags):
            source = meta_source(model)
            if isinstance(source, str):
                raise TrainingArgumentsError(
                    f"the model is on the meta device on every rank, but its weights cannot be read: {source}. "
                    "Build it with from_pretrained(DIR, device_map='meta', use_kernels=False) from a local directory "
                    "of safetensors, or pass the directory as Trainer(model=DIR)")
            return source
        if flags[0].item():
            raise TrainingArgumentsError(
                "the model is on the meta device on rank 0 but not on every rank: rank 0 must hold the weights the "
                "other ranks receive (fsdp_config 'cpu_ram_efficient_loading'); load it for real on rank 0, build "
                "it with from_pretrained(DIR, device_map='meta', use_kernels=False) on every rank, or pass "
                "Trainer(model=DIR)")
        if any(flag.item() for flag in flags[1:]):
            if not rank0_loading:
                raise TrainingArgumentsError(
                    "the model is on the meta device on some ranks > 0: set fsdp_config 'cpu_ram_efficient_loading' "
                    "to true so that they receive rank 0's weights")
            return RANK0
        if rank0_loading and self.world_size > 1 and self.rank == 0:
            warnings.warn(
                "fsdp_config 'cpu_ram_efficient_loading' was not applied: the model was passed already loaded on "
                "every rank (transformers' from_pretrained loads every weight on each rank; on an accelerator each "
                "rank then moves the whole model to its device before it is sharded). Load it with "
                "from_pretrained(DIR, device_map='meta', use_kernels=False) (it reads nothing; each rank then reads "
                "only its shards) or pass the directory as Trainer(model=DIR)", stacklevel=3)
        return IN_MODEL

    def prepare_forward(self, model: nn.Module) -> None:
        """At the start of training and evaluation: bf16 without FSDP runs the model's forward under autocast
        (`autocast_forward`), as Accelerate does for transformers' Trainer; FSDP2's bf16 is its parameters'."""
        if self.spec.fsdp is None and self.spec.mixed_precision == "bf16":
            autocast_forward(model, self.device.type)

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        """Sum `tensor` over the processes of `group` in place."""
        collectives.all_reduce(tensor, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank `src`'s `tensor` on every process, in place."""
        collectives.broadcast(tensor, src=src)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's `tensor`, in rank order."""
        every = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        collectives.all_gather(every, tensor)
        return every

    def is_sharded(self, model: nn.Module) -> bool:
        """Whether gradients are averaged over the data-parallel ranks by the wrapper (FSDP2)."""
        return isinstance(model, FSDPModule)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def step_end(self) -> None:
        """After the optimizer step and zero_grad (XLA: run the step's graph)."""

    def full_model_state(self, model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model on CPU on rank 0 (empty elsewhere); collective."""
        return self.state_access(model, None, trainable_only=trainable_only).full_model_state()
