"""A model's parallel layout, applied from outside in one place: context parallelism (its attention), then
tensor parallel -> expert parallel -> activation checkpointing, compile and FSDP per unit, torchtitan's order.
The Trainer (through its backend), the sharded loader (`load_pretrained(parallelize=...)`) and `shardtrain plan`
all call `apply_layout`, so what is planned is what runs.

    layout = runtime.layout()                  # the run's meshes, sizes and settings
    apply_layout(model, layout)                # in place; the model on its device or the meta device
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.parallel.context import ContextParallel
from shardtrain.parallel.dims import Meshes, ParallelDims
from shardtrain.parallel.expert import apply_ep, without_experts
from shardtrain.parallel.fsdp import apply_fsdp
from shardtrain.parallel.tensor import apply_tp, model_tp_plan


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where and how a model is laid out.

    Attributes:
        meshes: `ParallelDims.build(...)`'s meshes by purpose.
        dims: the parallel sizes.
        fsdp: the parsed `FSDPConfig`.
        tp_plan: the user's tensor-parallel plan (each pattern must match a module) or None: the model's own.
        mixed_precision: "bf16"/"fp16" or None/"no".
        compile_options: `torch.compile` options per FSDP unit, or None (eager).
        ep_implementation: transformers' `EPImplementationInterface` entry for the experts' token exchange.
        cp: context parallelism, or None.
    """

    meshes: Meshes
    dims: ParallelDims
    fsdp: FSDPConfig
    tp_plan: dict[str, str] | None = None
    mixed_precision: str | None = None
    compile_options: dict[str, Any] | None = None
    ep_implementation: str = "all_to_all"
    cp: ContextParallel | None = None



def apply_layout(model: nn.Module, layout: Layout) -> nn.Module:
    """Context parallelism, then `apply_parallelism`, in place; returns `model`."""
    if layout.cp is not None:
        layout.cp.enable(model)
    return apply_parallelism(model, layout.meshes, layout.dims, layout.fsdp, tp_plan=layout.tp_plan,
                             mixed_precision=layout.mixed_precision, compile_options=layout.compile_options,
                             ep_implementation=layout.ep_implementation)


def apply_parallelism(model: nn.Module, meshes: Meshes, dims: ParallelDims, fsdp_config: FSDPConfig, *,
                      tp_plan: dict[str, str] | None = None, mixed_precision: str | None = None,
                      compile_options: dict[str, Any] | None = None, ep_implementation: str = "all_to_all",
                      ) -> nn.Module:
    """Tensor parallel, expert parallel, then activation checkpointing, compile and FSDP per unit (`apply_fsdp`),
    in place (context parallelism already enabled: `apply_layout` does both).

    Args:
        model: the unsharded model on its device.
        meshes: `ParallelDims.build(...)`'s meshes.
        dims: the parallel sizes.
        fsdp_config: the parsed `FSDPConfig`.
        tp_plan: the user's tensor-parallel plan (each pattern must match a module) or None: the model's own.
        mixed_precision: "bf16"/"fp16" or None/"no".
        compile_options: `torch.compile` options per FSDP unit, or None (eager).
        ep_implementation: transformers' `EPImplementationInterface` entry for the experts' token exchange.
    """
    if dims.tp > 1:
        plan = tp_plan if tp_plan is not None else model_tp_plan(model)
        apply_tp(model, meshes.tp, without_experts(model, plan) if dims.ep > 1 else plan, strict=tp_plan is not None)
    if dims.ep > 1:
        apply_ep(model, meshes.ep, meshes.tp, ep_implementation=ep_implementation)
    apply_fsdp(model, fsdp_config, meshes.fsdp, mixed_precision=mixed_precision, expert_mesh=meshes.efsdp,
               expert_grad_divide_factor=dims.grad_average_size, compile_options=compile_options)
    return model
