"""The optimizer on Hugging Face's decay groups, its schedules, and gradient normalisation + clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from shardtrain.errors import TrainingArgumentsError
from shardtrain.train.arguments import TrainingArguments


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Hugging Face's `Trainer.get_decay_parameter_names`: every parameter but biases and norm weights."""
    import transformers

    return transformers.Trainer.get_decay_parameter_names(None, model)  # it reads nothing from the Trainer


def build_optimizer(model: nn.Module, *, decay_names: Iterable[str], weight_decay: float, cls: type,
                    kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """`cls(groups, **kwargs)` on Hugging Face's two groups: the trainable parameters named in `decay_names` with
    `weight_decay`, the others without. As Hugging Face, a `params`, `model` or `optimizer_dict` in `kwargs` (from
    a `get_optimizer_cls_and_kwargs` override) replaces the groups. The Trainer and `shardtrain plan` build it.

    The groups are not split per device mesh (transformers 5.24 does): they then do not depend on the layout, so
    a checkpoint resumes on another one (with or without expert parallelism); torch's fused and foreach AdamW
    step parameters of several meshes in one group.
    """
    decay = set(decay_names)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: Any = [{"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
                   {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
    kwargs = dict(kwargs)
    for key in ("params", "model", "optimizer_dict"):  # sentence-transformers adds its loss modules' parameters
        if key in kwargs:
            groups = kwargs.pop(key)
    return cls(groups, **kwargs)


def check_given_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse `Trainer(optimizers=(optimizer, ...))` over parameters the Trainer does not hold."""
    if optimizer is None:
        return
    held = {id(p) for p in model.parameters()}
    if not {id(p) for group in optimizer.param_groups for p in group["params"]} <= held:
        raise TrainingArgumentsError(
            "Trainer(optimizers=...) got an optimizer over parameters the Trainer does not train: FSDP replaces the "
            "model's parameters with sharded ones when the Trainer wraps it. Pass optimizer_cls_and_kwargs="
            "(torch.optim.AdamW, {...}) instead, or build the optimizer on trainer.model after creating the Trainer")


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, total_steps: int) -> LambdaLR:
    """transformers' own scheduler for `lr_scheduler_type` (so schedules match Hugging Face's step for step).

    Warmup is `args.warmup_for(total_steps)`; `lr_scheduler_kwargs` go to the scheduler (e.g. `min_lr_rate` for
    cosine_with_min_lr).
    """
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_for(total_steps),
                         num_training_steps=total_steps, scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs))


def steps_on_metric(scheduler: Any) -> bool:
    """Whether `scheduler` steps on an evaluation metric (ReduceLROnPlateau, transformers' GreedyLR), after each
    evaluation, instead of after each optimizer step (Hugging Face's rule)."""
    from transformers.optimization import GreedyLR

    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau | GreedyLR)


def _replication(grad: torch.Tensor, world_size: int) -> int:
    """On how many ranks this exact local gradient lives: the DTensor's Replicate dims, times the copies of its
    mesh in the world (an FSDP-only parameter lives on every tensor-parallel rank); plain tensors: all ranks."""
    if not isinstance(grad, DTensor):
        return world_size
    mesh = grad.device_mesh
    replicated = math.prod(mesh.size(dim) for dim, p in enumerate(grad.placements) if p.is_replicate())
    return replicated * (world_size // mesh.size())


def normalize_and_clip_grads(parameters: Iterable[nn.Parameter], local_counts: torch.Tensor, grad_divisor: float | None,
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
        grad_divisor: what the gradients were divided by (backward scale and FSDP's data-parallel average);
            None: they are the mean loss's already (only clipped).
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
    to_mean = grad_divisor / totals[1].clamp(min=1) if grad_divisor is not None else torch.ones_like(totals[1])
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
