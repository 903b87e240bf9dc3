"""AdamW with Hugging Face's decay grouping, warmup schedules, and DTensor-aware gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from shardtrain.train.arguments import TrainingArguments


def build_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.AdamW:
    """AdamW; biases and norm weights (1-D parameters) get no weight decay, as in Hugging Face Trainer."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)


def lr_lambda(kind: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base learning rate at a step: linear warmup, then linear / cosine / constant."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return step / warmup_steps if kind != "constant" else 1.0
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lr_lambda(args.lr_scheduler_type, args.warmup_steps, total_steps))


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Total gradient 2-norm over all ranks (DTensor shards reduced), clipped in place when max_norm > 0."""
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
