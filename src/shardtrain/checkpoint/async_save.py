"""Pieces of `CheckpointManager.save_async`: checkpoints written in the background while training continues.

`TrainingArguments(save_async=True)` makes the Trainer call `CheckpointManager.save_async` instead of `save`.
What happens, and the decisions behind it:

1. **Wait for the previous save** (`CheckpointManager.wait`): at most one save is in flight. Waiting is a
   collective agreement (the same `AtomicWrites.run_agreed` all-reduce as the synchronous path, on the default
   group, from the main thread): an error of the background write (disk full, permissions, a failed commit) is raised
   on every rank at this point, so no rank hangs and the partial `.tmp-checkpoint-<step>` is removed.
2. **Synchronous part** (the training loop is blocked): rank 0 creates `.tmp-checkpoint-<step>`; every rank
   *stages* its shard of the model and optimizer state, i.e. copies it into CPU buffers owned by the manager
   (`ReusableStager`), so the written checkpoint is exactly the state at the step it names whatever training
   does next; then the small files (`trainer_state.json`, `scheduler.json`, `rng_state_<rank>.pt`,
   `config.json`, `tied_weights.json`) are written. Every rank agrees that this part worked (an all-reduce)
   *before* anything starts in the background: a rank that failed to stage must not leave its peers inside
   a background collective that it never joins.
3. **Background part**: `torch.distributed.checkpoint.async_save` (thread executor, `process_group` = a
   dedicated gloo group, the already staged dict with a pass-through stager) writes the DCP files
   (`SHARDED_STATE_DICT`: `sharded/`, model + optimizer; `FULL_STATE_DICT`: `optimizer/`). DCP's async save
   needs a CPU backend, so this works when the training group is NCCL, and checkpoint collectives never
   interleave with training collectives on one communicator. The gloo groups are created once per manager
   (`dist.new_group(backend="gloo")`), i.e. once per Trainer.
   `FULL_STATE_DICT`'s `model.safetensors` is written in the background too, not synchronously: the staged
   FSDP shards are gathered on rank 0 over a second gloo group (`gather_full`; a second group because DCP's
   thread uses the first one at the same time), and rank 0 writes the file. Only when the model is not
   plain FSDP (HSDP: a 2-D mesh) is it gathered synchronously in step 2, through the training group
   (`full_model_state`), and only its write is in the background.
4. **Commit** (background, rank 0, in the manager's own worker thread): when rank 0's DCP future has
   completed (DCP's finish step gathers every rank's write results on rank 0, so every rank has written its
   files by then) and the safetensors write is done, rank 0 writes `manifest.json`, fsyncs, renames
   `.tmp-checkpoint-<step>` → `checkpoint-<step>` and rotates (`save_total_limit`, keeping the best checkpoint
   as it was when the save started), as the synchronous path does. So a crash before the commit leaves only
   the `.tmp-` directory, never an incomplete `checkpoint-<step>`, and the fsync does not block training.
5. `Trainer.train()` waits (step 1) before it returns, so a finished run always has its last checkpoint named.
   The `on_save` callback runs when a save has been started, not committed. If training raises while a
   save is in flight, nothing waits for it collectively: its thread finishes (and commits) before the
   process exits, or the process dies first and leaves the `.tmp-` directory.

Staging buffers are kept from one save to the next: copying into warm buffers is ~4x faster than into fresh
ones (page faults), and the copy is one `copy_` per tensor (DCP's `DefaultStager` deep-copies every DTensor
in Python at each save, which on the 50m benchmark model costs as much as the copy). The price is one CPU
copy of this rank's model + optimizer shard held for the life of the Trainer (pinned when CUDA is present).
Thread, not process, executor: no second process, process group or shared-memory copy. The background thread
shares the GIL and the CPU with the training loop; on a machine whose cores all train (the CPU benchmark),
steps that run while a save is in flight are slower (see benchmarks/results/async_save.json).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardtrain.errors import CheckpointError
from shardtrain.parallel import collectives


class AlreadyStaged(AsyncStager):
    """A stager that returns the state dict as it is: the manager has staged it before calling async_save."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def close(self) -> None:
        pass


class ReusableStager:
    """Copies the tensors of a state dict into CPU buffers that are kept and reused by the next save.

    The staged dict has the same structure; a DTensor becomes a DTensor with the same spec (mesh, placements,
    global shape) around a CPU copy of its local shard, so DCP plans and writes it exactly as the original.
    The buffers and staged DTensors are made once (again only if the structure, shapes or dtypes change);
    later saves are one `copy_` per tensor. DCP's `DefaultStager` gives the same result, but walks every
    DTensor with a Python deepcopy at every save (as long as the copy itself on the 50m benchmark model).
    """

    def __init__(self) -> None:
        self._signature: Any = None
        self._buffers: list[torch.Tensor] = []
        self._staged: list[torch.Tensor] = []

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        leaves, spec = tree_flatten(state_dict)
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in where]
        local = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
        signature = (spec, [(type(t), t.shape, x.shape, x.stride(), x.dtype, getattr(t, "_spec", None))
                            for t, x in zip(tensors, local, strict=True)])
        if signature != self._signature:
            pin = torch.cuda.is_available()
            self._buffers = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu", pin_memory=pin)
                             for x in local]
            self._staged = [DTensor(b, t._spec, requires_grad=False) if isinstance(t, DTensor) else b
                            for t, b in zip(tensors, self._buffers, strict=True)]
            self._signature = signature
        on_device = False
        for buffer, x in zip(self._buffers, local, strict=True):
            on_device |= x.device.type != "cpu"
            buffer.copy_(x, non_blocking=x.device.type == "cuda")
        if on_device and torch.cuda.is_available():
            torch.cuda.synchronize()
        staged = list(leaves)
        for i, tensor in zip(where, self._staged, strict=True):
            staged[i] = tensor
        return tree_unflatten(staged, spec)

    def close(self) -> None:
        self._signature, self._buffers, self._staged = None, [], []


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group over all ranks for checkpoint collectives (collective: every rank must call it); None on a
    one-process run without a process group (`collectives`)."""
    return dist.new_group(backend="gloo") if collectives.group_is_up() else None


def group_agree(group: dist.ProcessGroup, problem: str | None) -> None:
    """Collective over `group`: if any rank passed a problem, every rank raises `CheckpointError` with the
    lowest rank's (the background half of an async save agrees on its own group, never the training's)."""
    problems = [p for p in collectives.gather_objects(problem, group) if p is not None]
    if problems:
        raise CheckpointError(problems[0])


def gatherable(model_state: dict[str, Any]) -> bool:
    """Whether `gather_full` can assemble this (sharded) model state: every DTensor is FSDP's Shard(0) on a
    1-D mesh of all ranks in rank order (not HSDP, whose full model `full_model_state` gathers instead)."""
    ranks = list(range(dist.get_world_size()))
    return all(t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.device_mesh.mesh.tolist() == ranks
               for t in model_state.values() if isinstance(t, DTensor))


def gather_full(staged: dict[str, Any], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The whole model on rank 0 ({} elsewhere), from staged Shard(0) shards, over `group` (collective).

    FSDP2 (like DTensor's Shard) splits dim 0 with `torch.chunk`: rank r holds rows [r*c, (r+1)*c) of
    ceil(n / world) = c rows each, the last ones fewer or none. Each shard is padded to c rows, gathered into
    one buffer on rank 0 and cut to n rows: the same tensor as `full_tensor()`, without the training group.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    full: dict[str, torch.Tensor] = {}
    for key, tensor in staged.items():
        if not isinstance(tensor, DTensor):
            if rank == 0:
                full[key] = tensor
            continue
        local, rows = tensor._local_tensor, tensor.shape[0]
        chunk = -(-rows // world)
        if chunk == 0:
            if rank == 0:
                full[key] = torch.empty(tensor.shape, dtype=local.dtype)
            continue
        send = local.contiguous()
        if local.shape[0] < chunk:
            send = torch.cat([send, send.new_zeros((chunk - local.shape[0], *tensor.shape[1:]))])
        if rank == 0:
            out = torch.empty((chunk * world, *tensor.shape[1:]), dtype=local.dtype)
            dist.gather(send, list(out.chunk(world)), dst=dist.get_global_rank(group, 0), group=group)
            full[key] = out[:rows]
        else:
            dist.gather(send, None, dst=dist.get_global_rank(group, 0), group=group)
    return full


def private_copy(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state` with every tensor that shares storage with a live model tensor cloned (so training cannot change
    it while it is written). FSDP's gathered full tensors are fresh and are not copied again."""
    live = set()
    for tensor in model.state_dict().values():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            live.add(local.untyped_storage().data_ptr())
    return {key: value.clone() if value.numel() and value.untyped_storage().data_ptr() in live else value
            for key, value in state.items()}


@dataclass
class InFlightSave:
    """A save whose background part was started: `future` completes when it is written (and on rank 0 committed)."""

    step: int
    tmp: Path
    final: Path
    future: Future


def background_job(write_model: Callable[[], None] | None, upload: Future | None,
                   commit: Callable[[], None] | None) -> None:
    """Run in the manager's worker thread: this rank's own writes, then wait for DCP, then (rank 0) commit.

    The DCP future is always waited for, even after a failed write, so that nothing of this save is still
    running when the next wait point cleans up or the next save starts DCP collectives on the same group.
    """
    error: BaseException | None = None
    if write_model is not None:
        try:
            write_model()
        except (Exception, CheckpointException) as err:  # noqa: B014 - DCP's error is not always an Exception
            error = err
    if upload is not None:
        try:
            upload.result()
        except (Exception, CheckpointException) as err:  # noqa: B014
            error = error or err
    if error is not None:
        raise error
    if commit is not None:
        commit()
