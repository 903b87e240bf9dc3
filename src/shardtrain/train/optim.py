"""AdamW with Hugging Face's decay grouping, warmup schedules, and gradient normalisation + clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from shardtrain.train.arguments import TrainingArguments


def build_optimizer(model: nn.Module, args: TrainingArguments,
                    cls_and_kwargs: tuple[type, dict[str, Any]] | None = None) -> torch.optim.Optimizer:
    """AdamW (or `cls_and_kwargs`); biases and norm weights (1-D parameters) get no weight decay, as in Hugging
    Face Trainer.

    `optim="adamw_torch_fused"` (the default, as in Hugging Face) updates each parameter in one kernel, with no
    temporary tensors; "adamw_torch" is the multi-tensor (foreach) implementation. Devices without a fused
    kernel get foreach. `cls_and_kwargs` (Trainer's `optimizer_cls_and_kwargs`) is built on the same groups.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cls_and_kwargs is not None:
        cls, kwargs = cls_and_kwargs
        return cls(groups, **kwargs)
    devices = {p.device.type for p in decay + no_decay}
    fused = args.optim == "adamw_torch_fused" and devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, total_steps: int) -> LambdaLR:
    """transformers' own scheduler for `lr_scheduler_type` (so schedules match Hugging Face's step for step).

    Warmup is `args.warmup_for(total_steps)`; `lr_scheduler_kwargs` go to the scheduler (e.g. `min_lr_rate` for
    cosine_with_min_lr).
    """
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_for(total_steps),
                         num_training_steps=total_steps, scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs))


def _replication(grad: torch.Tensor, world_size: int) -> int:
    """On how many ranks this exact local gradient lives: the DTensor's Replicate dims, times the copies of its
    mesh in the world (an FSDP-only parameter lives on every tensor-parallel rank); plain tensors: all ranks."""
    if not isinstance(grad, DTensor):
        return world_size
    mesh = grad.device_mesh
    replicated = math.prod(mesh.size(dim) for dim, p in enumerate(grad.placements) if p.is_replicate())
    return replicated * (world_size // mesh.size())


def normalize_and_clip_grads(parameters: Iterable[nn.Parameter], local_counts: torch.Tensor, grad_divisor: float,
                             max_norm: float, world_size: int, count_copies: int = 1) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """Turn gradients of a token *sum* into gradients of the token *mean*, and clip them, with one all-reduce.

    The gradients hold d(sum of token losses over all ranks) / `grad_divisor`. The number of target tokens
    is only known globally, so it travels in the same all-reduce as the squared gradient norm: one collective
    per step instead of two. The norm is computed on the local shards of the DTensor gradients (shards that
    are replicated, as in HSDP, are counted once), and one `_foreach_mul_` both normalises and clips.

    Args:
        parameters: the model's parameters.
        local_counts: this rank's counts (float64, on the collective's device); element 0 must be the number
            of target tokens. All elements are summed over ranks.
        grad_divisor: what the gradients were divided by (backward scale and FSDP's data-parallel average).
        max_norm: clip the gradient norm to this; <= 0: no clipping.
        world_size: ranks in the default process group.
        count_copies: on how many ranks each count is made (tensor-parallel ranks share their batch).

    Returns:
        (total gradient 2-norm of the mean loss before clipping, the summed counts).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    locals_: list[torch.Tensor] = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    sumsq = torch.zeros((), dtype=torch.float64, device=local_counts.device)
    by_replication: dict[int, list[torch.Tensor]] = {}
    for grad, local in zip(grads, locals_, strict=True):
        if local.numel():
            by_replication.setdefault(_replication(grad, world_size), []).append(local)
    for replication, tensors in by_replication.items():
        norms = torch._foreach_norm(tensors, 2.0)
        part = torch.stack([n.to(torch.float64) for n in norms]).square().sum() / replication
        sumsq += part.to(sumsq.device)
    totals = torch.cat([sumsq.view(1), local_counts.to(torch.float64)])
    if world_size > 1:
        dist.all_reduce(totals)
    if count_copies > 1:
        totals[1:] /= count_copies
    to_mean = grad_divisor / totals[1].clamp(min=1)
    norm = totals[0].sqrt() * to_mean
    factor = to_mean
    if max_norm > 0:
        factor = to_mean * (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for device_locals in _by_device(locals_).values():
        torch._foreach_mul_(device_locals, factor.to(device_locals[0].device, torch.float32))
    return norm.float(), totals[1:]


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups
