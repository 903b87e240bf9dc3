"""A model's parallel layout, applied from outside in one place, stage by stage in torchtitan's order: the
pipeline split (this rank's stage of the model), context parallelism (its attention), tensor parallel, expert
parallel, then on the wrap policy's units activation checkpointing, compile and FSDP.
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
from shardtrain.parallel.expert import apply_ep, find_experts, without_experts
from shardtrain.parallel.fsdp import apply_activation_checkpointing, apply_compile, apply_fsdp, fsdp_units
from shardtrain.parallel.pipeline import split_for_rank
from shardtrain.parallel.pipeline_settings import PipelineSettings
from shardtrain.parallel.tensor import apply_tp, model_tp_plan, refuse_replicated_experts


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
        pipeline: the pipeline's schedule and microbatches (used when `dims.pp` > 1).
    """

    meshes: Meshes
    dims: ParallelDims
    fsdp: FSDPConfig
    tp_plan: dict[str, str] | None = None
    mixed_precision: str | None = None
    compile_options: dict[str, Any] | None = None
    ep_implementation: str = "all_to_all"
    cp: ContextParallel | None = None
    pipeline: PipelineSettings = PipelineSettings()


def apply_layout(model: nn.Module, layout: Layout) -> nn.Module:
    """Every stage, in torchtitan's order, in place, on the model's device (or the meta device); returns `model`.
    Each stage is one call that the settings switch (a size of 1, `ac_mode` "none", no compile options)."""
    meshes, dims = layout.meshes, layout.dims
    if dims.pp > 1:  # this rank's stages: the other stages' modules are skipped (`pipeline_split`)
        split_for_rank(model, layout.pipeline, meshes.pp.get_local_rank(), dims.pp)
    if layout.cp is not None:  # context parallelism: the attention of each sequence part
        layout.cp.enable(model)
    if dims.tp > 1:
        plan = layout.tp_plan if layout.tp_plan is not None else model_tp_plan(model)
        if dims.ep == 1 and layout.tp_plan is None and find_experts(model):  # (transformers >= 5.25's MoE plans
            refuse_replicated_experts(model, dims.tp)                        # no longer name the experts)
        apply_tp(model, meshes.tp, without_experts(model, plan) if dims.ep > 1 else plan,
                 strict=layout.tp_plan is not None)
    if dims.ep > 1:
        apply_ep(model, meshes.ep, meshes.tp, ep_implementation=layout.ep_implementation)
    # the wrap policy's blocks: the unit of activation checkpointing, of compile and of FSDP
    units, head = fsdp_units(model, layout.fsdp)
    units = apply_activation_checkpointing(model, units, layout.fsdp)
    apply_compile(model, units, layout.compile_options)
    apply_fsdp(model, layout.fsdp, meshes.fsdp, mixed_precision=layout.mixed_precision, expert_mesh=meshes.efsdp,
               expert_grad_divide_factor=dims.grad_average_size, units=(units, head))
    return model
