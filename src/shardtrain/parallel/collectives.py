"""`torch.distributed`'s calls as the Trainer's own code makes them, on a run with or without a process group.

A one-process run that shards nothing starts no process group, as transformers' Trainer on one process does
(`TrainingBackend.setup`): a script, or a library's cleanup, that asks `dist.is_initialized()` finds what it
would find under transformers. Everything else in the engine still makes its collectives the same way; here each
one is the identity on that run (one rank: its own value) and `torch.distributed`'s own call otherwise.

    from shardtrain.parallel import collectives
    collectives.all_reduce(totals, group=loss_group)     # dist.all_reduce, or nothing on one process
    found = collectives.gather_objects(problem)          # every rank's object, in rank order
    collectives.agree(problem, DataError)                # every rank raises the lowest rank's problem
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardtrain.errors import DataError, UserError


def group_is_up() -> bool:
    """Whether a default process group exists (a run of several processes, or one that shards its model)."""
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if group_is_up() else 1


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if group_is_up() else 0


def get_backend(group: Any = None) -> str:
    """The group's backend; "gloo" (host tensors) without a process group."""
    return dist.get_backend(group) if group_is_up() else "gloo"


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
    """Sum (or `op`) `tensor` over `group` in place."""
    if group_is_up():
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None) -> None:
    if group_is_up():
        dist.broadcast(tensor, src=src, group=group)


def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    if group_is_up():
        dist.all_gather(out, tensor, group=group)
    else:
        out[0].copy_(tensor)


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value` (picklable), in rank order (`all_gather_object`)."""
    if not group_is_up():
        return [value]
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, value, group=group)
    return found


def agree(problem: str | None, error: type[UserError] = DataError) -> None:
    """Collective: if any rank found a problem, every rank raises `error` with the lowest rank's message."""
    problems = [p for p in gather_objects(problem) if p is not None]
    if problems:
        raise error(problems[0])


def per_rank(value: Any) -> list[Any]:
    """Collective: every rank's `value` (picklable), in rank order."""
    return gather_objects(value)


def over_data_ranks(local: int, all_reduce: Any, device: torch.device, dp_size: int, world_size: int) -> int:
    """Collective: `local` (a count this rank holds, the same on the cp and tp ranks of its data-parallel group)
    summed over the `dp_size` data-parallel ranks, through `all_reduce` over all `world_size` ranks."""
    count = torch.tensor([float(local)], dtype=torch.float64, device=device)
    all_reduce(count)
    return round(count.item() * dp_size / world_size)
