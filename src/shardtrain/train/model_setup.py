"""How the Trainer prepares its model and batches for the parallel layout: adapters (LoRA), context
parallelism, tensor parallelism, FSDP, in that order, and each batch's split over the `cp` ranks. Part of
`Trainer`: it uses the Trainer's run description (`spec`), `dims`, `meshes`, `cp`, `loss`, `device` and
`world_size`."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardtrain.checkpoint.model_state import frozen_digests, frozen_identity
from shardtrain.errors import PeftError, TrainingArgumentsError
from shardtrain.parallel.backend import apply_parallelism
from shardtrain.parallel.loading import load_pretrained
from shardtrain.train.lora import add_adapters, is_peft_model
from shardtrain.train.loss import is_causal_lm
from shardtrain.train.router_loss import RouterLoss

# attributes where libraries built on Hugging Face's Trainer keep frozen models next to the trained one
SIDE_MODELS = ("ref_model", "teacher_model", "reward_model")


class ModelSetupMixin:
    """`_prepare_model` (once, in `Trainer.__init__`) and `_model_inputs` (every batch)."""

    def _prepare_model(self, model: nn.Module | str, peft_config: Any = None) -> nn.Module:
        spec = self.spec
        self._frozen_base = None  # adapter training: the base's identity, recorded in checkpoints
        if peft_config is not None:
            if isinstance(model, str | os.PathLike):
                raise PeftError("peft_config needs a model object: load it first (e.g. AutoModelForCausalLM."
                                "from_pretrained(path)) and pass it with peft_config")
            model = add_adapters(model, peft_config)
        if is_peft_model(model):  # before sharding (full tensors); each rank hashes a share of the base
            shares: list[Any] = [None] * self.world_size
            dist.all_gather_object(shares, frozen_digests(model, self.rank, self.world_size))
            self._frozen_base = frozen_identity(model, {k: v for share in shares for k, v in share.items()})
        # A model path takes any layout, ep included: the loader reads per-expert checkpoint keys into the fused,
        # expert-sharded weights by transformers' own conversion rules (or falls back to rank 0's broadcast)
        for name, size in (("tp_size", self.dims.tp), ("ep_size", self.dims.ep)):
            if self._frozen_base is not None and size > 1:
                raise PeftError(f"{name} = {size} with LoRA adapters is not supported yet; train the adapters "
                                f"with data (and context) parallelism, {name} 1")
        if isinstance(model, str | os.PathLike):
            model = load_pretrained(model, spec.fsdp, mesh=self.meshes.fsdp, mixed_precision=spec.mixed_precision,
                                    device=self.device, compile_options=spec.compile_options,
                                    parallelize=lambda m: apply_parallelism(
                                        m, self.meshes, self.dims, spec.fsdp, tp_plan=spec.tp_plan,
                                        mixed_precision=spec.mixed_precision, compile_options=spec.compile_options))
            self._enable_context_parallel(model)
            return model
        self._enable_context_parallel(model)
        if spec.gradient_checkpointing is not None and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(spec.gradient_checkpointing))
        return self.backend.parallelize(model, self.meshes, self.dims, adapters=self._frozen_base is not None)

    def _parallelize_side_models(self) -> None:
        """A library's frozen extra models (TRL's `ref_model`, `teacher_model`, ...) sharded like the trained one,
        on the same meshes, so that no rank holds a full copy while training; they run in eval mode."""
        for name in SIDE_MODELS:
            side = getattr(self, name, None)
            if isinstance(side, nn.Module) and side is not self.model and not self.backend.is_sharded(side):
                side.requires_grad_(False)
                setattr(self, name, self.backend.parallelize(side, self.meshes, self.dims).eval())

    def _enable_context_parallel(self, model: nn.Module) -> None:
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
        self.cp.enable(model)

    # a causal LM batch without labels learns every token; a library's trainer (shardtrain.on_engine) gets its
    # collator's batches as they are, as under Hugging Face
    labels_from_inputs = True

    def _model_inputs(self, batch: dict[str, torch.Tensor], add_labels: bool = True) -> dict[str, Any]:
        """A collated batch as the model gets it: on the device, with labels (`add_labels` and
        `labels_from_inputs`); split over `cp` under context parallelism."""
        batch = self.backend.to_device(batch)
        if add_labels and self.labels_from_inputs:
            batch = self.loss_computer.with_labels(batch)
        if self.cp is None:
            return batch
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return self.cp.shard(batch, shift_labels=self.loss_computer.shift_labels, pad_token_id=pad or 0)
