"""How a model is laid out for the run, in order: adapters (LoRA), context parallelism, then the backend's
`parallelize` (tensor parallel -> expert parallel -> activation checkpointing -> compile -> FSDP); and how each
batch reaches it (on the device, split over the `cp` ranks). A part of the Trainer, built once from the runtime.

    preparation = ModelPreparation(runtime)       # a parallel.runtime.Runtime
    model, frozen_base = preparation.prepare(model_or_path, peft_config)
    pipeline = preparation.pipeline(model)        # this rank's pipeline stage and schedule (pp > 1), else None
    inputs = preparation.inputs(batch, loss_computer, with_labels=True)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from shardtrain.checkpoint.model_state import frozen_digests, frozen_identity
from shardtrain.errors import PeftError, TrainingArgumentsError
from shardtrain.parallel import collectives
from shardtrain.parallel.context import ContextParallel
from shardtrain.parallel.dims import Meshes, ParallelDims
from shardtrain.parallel.fsdp import shard_stage_root
from shardtrain.parallel.layout import apply_layout
from shardtrain.parallel.loading import load_pretrained
from shardtrain.parallel.pipeline import Pipeline
from shardtrain.parallel.pipeline_split import stage_split
from shardtrain.parallel.runtime import Runtime
from shardtrain.train.model.lora import add_adapters, is_peft_model
from shardtrain.train.step.loss import LossComputer, is_causal_lm
from shardtrain.train.step.router_loss import RouterLoss

# attributes where libraries built on Hugging Face's Trainer keep frozen models next to the trained one
SIDE_MODELS = ("ref_model", "teacher_model", "reward_model")


@dataclass(frozen=True)
class ModelPreparation:
    """Lays models out on the run's meshes (see module docstring)."""

    runtime: Runtime

    @property
    def meshes(self) -> Meshes:
        return self.runtime.meshes

    @property
    def dims(self) -> ParallelDims:
        return self.runtime.dims

    @property
    def cp(self) -> ContextParallel | None:
        return self.runtime.cp

    def prepare(self, model: nn.Module | str | os.PathLike, peft_config: Any = None) -> tuple[nn.Module, Any]:
        """The trained model laid out (adapters added from `peft_config`; a path loaded, each rank reading its
        shards), and the identity of its frozen base when it trains adapters (recorded in checkpoints), else None.
        """
        spec, dims, backend = self.runtime.spec, self.dims, self.runtime.backend
        frozen_base = None
        if peft_config is not None:
            if isinstance(model, str | os.PathLike):
                raise PeftError("peft_config needs a model object: load it first (e.g. AutoModelForCausalLM."
                                "from_pretrained(path)) and pass it with peft_config")
            model = add_adapters(model, peft_config)
        if is_peft_model(model):  # before sharding (full tensors); each rank hashes a share of the base
            shares = collectives.gather_objects(frozen_digests(model, backend.rank, backend.world_size))
            frozen_base = frozen_identity(model, {k: v for share in shares for k, v in share.items()})
        for name, size in (("tp_size", dims.tp), ("ep_size", dims.ep)):
            if frozen_base is not None and size > 1:
                raise PeftError(f"{name} = {size} with LoRA adapters is not supported yet; train the adapters "
                                f"with data (and context) parallelism, {name} 1")
        if isinstance(model, str | os.PathLike):
            # A model path takes any layout, ep included: the loader reads per-expert checkpoint keys into the
            # fused, expert-sharded weights by transformers' own conversion rules (or falls back to rank 0's
            # broadcast)
            layout = self.runtime.layout()
            model = load_pretrained(model, spec.fsdp, mesh=self.meshes.fsdp, mixed_precision=spec.mixed_precision,
                                    device=backend.device, compile_options=spec.compile_options,
                                    parallelize=partial(apply_layout, layout=layout))
            self._check_context_parallel(model)
            return model, frozen_base
        self._check_context_parallel(model)
        if spec.gradient_checkpointing is not None and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(spec.gradient_checkpointing))
        return backend.parallelize(model, self.runtime.layout(), adapters=frozen_base is not None), frozen_base

    def pipeline(self, model: nn.Module) -> Pipeline | None:
        """This rank's stage of the pipeline over `model` (laid out by `prepare`) and its schedule; None without
        a pipeline (pp 1)."""
        if self.dims.pp == 1:
            return None
        spec = self.runtime.spec
        layout = self.runtime.layout()
        return Pipeline.build(model, stage_split(model), pp_mesh=self.meshes.pp, settings=layout.pipeline,
                              device=self.runtime.device,
                              shard_root=partial(shard_stage_root, fsdp_config=spec.fsdp, mesh=self.meshes.fsdp,
                                                 mixed_precision=spec.mixed_precision))

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """A library's frozen extra model (TRL's `ref_model`, ...) sharded like the trained one, on the same
        meshes, in eval mode; one already sharded is returned as it is."""
        if self.runtime.backend.is_sharded(model):
            return model
        model.requires_grad_(False)
        # as before context parallelism was part of the layout: a side model's attention is not split
        layout = replace(self.runtime.layout(), cp=None)
        return self.runtime.backend.parallelize(model, layout).eval()

    def inputs(self, batch: dict[str, torch.Tensor], loss_computer: LossComputer, *,
               with_labels: bool) -> dict[str, Any]:
        """A collated batch as the model gets it: on the device, with labels made from the inputs
        (`with_labels`), split over `cp` under context parallelism."""
        batch = self.runtime.backend.to_device(batch)
        if with_labels:
            batch = loss_computer.with_labels(batch)
        if self.cp is None:
            return batch
        pad = getattr(getattr(loss_computer.model, "config", None), "pad_token_id", None)
        return self.cp.shard(batch, shift_labels=loss_computer.shift_labels, pad_token_id=pad or 0)

    def _check_context_parallel(self, model: nn.Module) -> None:
        """Refuse a model context parallelism cannot split (the layout enables it)."""
        if self.cp is None:
            return
        if not is_causal_lm(model):
            raise TrainingArgumentsError(
                f"cp_size = {self.dims.cp}: context parallelism splits the sequences of causal language models; "
                f"{type(model).__name__} is not one (its outputs depend on the whole sequence); set cp_size to 1")
        if RouterLoss(model, None).enabled:
            raise TrainingArgumentsError(
                f"cp_size = {self.dims.cp} with {type(model).__name__}'s load-balancing loss (config."
                "output_router_logits): the router statistics under context parallelism are not supported yet; "
                "set cp_size to 1, or config.output_router_logits = False")
