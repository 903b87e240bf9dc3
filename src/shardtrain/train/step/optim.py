"""The optimizer on Hugging Face's decay groups, its schedules, and gradient normalisation + clipping."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from shardtrain.errors import TrainingArgumentsError
from shardtrain.parallel import collectives
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


def clip_grads(parameters: Iterable[nn.Parameter], max_norm: float, world_size: int,
               device: torch.device, carry: torch.Tensor | None = None, *, stage_size: int | None = None,
               uncounted: set[int] = frozenset()) -> torch.Tensor:
    """Clip the gradients (of the step's mean loss) to `max_norm` in one all-reduce; their 2-norm before clipping.

    The norm is computed on the local shards of the DTensor gradients (shards that are replicated, as in HSDP, are
    counted once); the squared norms of every rank travel in one all-reduce, and one `_foreach_mul_` clips.

    Args:
        parameters: the model's parameters.
        max_norm: clip the gradient norm to this; <= 0: no clipping (the norm is still computed: it is logged).
        world_size: ranks in the default process group.
        device: the collective's device (the run's; CPU-offloaded gradients are summed there too).
        carry: float64 values summed over the ranks in the same all-reduce (in place): the step guard's loss sum.
        stage_size: the ranks of one pipeline stage (its parameters live on those only); None: the world.
        uncounted: ids of parameters clipped but left out of the norm (a pipeline's second copy of tied embeddings).
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    locals_: list[torch.Tensor] = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    sumsq = torch.zeros((), dtype=torch.float64, device=device)
    by_replication: dict[int, list[torch.Tensor]] = {}
    for param, grad, local in zip(parameters, grads, locals_, strict=True):
        if local.numel() and id(param) not in uncounted:
            by_replication.setdefault(_replication(grad, stage_size or world_size), []).append(local)
    for replication, tensors in by_replication.items():
        norms = torch._foreach_norm(tensors, 2.0)
        part = torch.stack([n.to(torch.float64) for n in norms]).square().sum() / replication
        sumsq += part.to(sumsq.device)
    if carry is not None:  # one all-reduce for both
        both = torch.cat([sumsq.reshape(1), carry.to(sumsq.device, torch.float64).reshape(-1)])
        if world_size > 1:
            collectives.all_reduce(both)
        sumsq = both[0]
        carry.copy_(both[1:].reshape(carry.shape).to(carry.device))
    elif world_size > 1:
        collectives.all_reduce(sumsq)
    norm = sumsq.sqrt()
    if max_norm > 0:
        factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for device_locals in _by_device(locals_).values():
            torch._foreach_mul_(device_locals, factor.to(device_locals[0].device, torch.float32))
    return norm.float()


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def current_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any) -> float:
    """The rate the next optimizer step uses: the scheduler's (the optimizer's own when it steps on a metric)."""
    return optimizer.param_groups[0]["lr"] if steps_on_metric(scheduler) else scheduler.get_last_lr()[0]


def discard_step(optimizer: torch.optim.Optimizer, scheduler: Any, backend: Any) -> float:
    """A step the guard skipped: its gradients dropped, no optimizer or scheduler step; the learning rate it had."""
    optimizer.zero_grad(set_to_none=True)
    backend.step_end()
    return current_learning_rate(optimizer, scheduler)


def step_optimizer_and_scheduler(optimizer: torch.optim.Optimizer, scheduler: Any, backend: Any,
                                 fire: Callable[[str], None]) -> float:
    """Hugging Face's optimizer step: `on_pre_optimizer_step`, the backend's optimizer step, `on_optimizer_step`,
    the scheduler's step (unless it steps on a metric, after each evaluation) and clearing the gradients; the
    learning rate the step used."""
    fire("on_pre_optimizer_step")
    backend.optimizer_step(optimizer)
    fire("on_optimizer_step")
    learning_rate = current_learning_rate(optimizer, scheduler)
    if not steps_on_metric(scheduler):
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    backend.step_end()
    return learning_rate
