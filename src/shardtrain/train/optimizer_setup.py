"""Optimizer and scheduler as Hugging Face's Trainer builds them, on the sharded parameters. Part of `Trainer`."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.optim import build_scheduler


class OptimizerSetupMixin:
    """`create_optimizer`, `get_optimizer_cls_and_kwargs`, `create_scheduler` (Hugging Face's override points)."""

    def _check_given_optimizer(self) -> None:
        if self.optimizer is None:
            return
        held = {id(p) for p in self.model.parameters()}
        given = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if not given <= held:
            raise TrainingArgumentsError(
                "Trainer(optimizers=...) got an optimizer over parameters the Trainer does not train: FSDP "
                "replaces the model's parameters with sharded ones when the Trainer wraps it. Pass "
                "optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}) instead, or build the optimizer on "
                "trainer.model after creating the Trainer")

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Hugging Face's: `create_optimizer()`, then `create_scheduler(num_training_steps)`."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Hugging Face's optimizer: `get_decay_parameter_names` grouping, `optimizer_cls_and_kwargs` or
        `get_optimizer_cls_and_kwargs(args)`, built on the sharded parameters the Trainer holds.

        Unlike transformers 5.24 the two groups are not split per device mesh: the groups then do not depend on
        the layout, so a checkpoint resumes on another one (with or without expert parallelism); torch's fused
        and foreach AdamW step parameters of several meshes in one group.
        """
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(opt_model))
            params = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in params if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
            cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            kwargs = dict(kwargs)
            for key in ("params", "model", "optimizer_dict"):  # Hugging Face's: groups chosen by the override
                if key in kwargs:  # (sentence-transformers adds its loss modules' parameters this way)
                    groups = kwargs.pop(key)
            self.optimizer = cls(groups, **kwargs)
        return self.optimizer

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: transformers.TrainingArguments, model: Any = None) -> tuple[Any, Any]:
        """Hugging Face's choice for `args.optim`; the fused AdamW kernel only where torch has one (CPU, CUDA)."""
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        devices = {p.device.type for p in model.parameters()} if model is not None else set()
        if kwargs.get("fused") and not devices <= {"cpu", "cuda"}:
            kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
        return cls, kwargs

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """transformers' scheduler for `lr_scheduler_type` (warmup: `warmup_steps`, a ratio when below 1)."""
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, self.args, num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler
