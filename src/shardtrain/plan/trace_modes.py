"""The dispatch modes and contexts the traced step runs under (`shardtrain.plan.trace`): counting collectives
(bytes, and bytes on the wire over each op's own group) and matmul shapes, gloo's reduce-scatter copy, FLOPs, and
DeviceMesh construction outside the fake mode, and the memory tracker of the traced step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

COLLECTIVE_KINDS = ("allgather", "reduce_scatter", "allreduce", "other")


def collective_kind(name: str) -> str:
    """A c10d op's name as one of `COLLECTIVE_KINDS` (backends move bytes at a different rate for each)."""
    for kind in COLLECTIVE_KINDS[:3]:
        if name.replace("_", "").startswith(kind.replace("_", "")):
            return kind
    return "other"


class CollectiveCounter(TorchDispatchMode):
    """Bytes of each c10d collective's larger buffer on this rank (all-gather output, reduce-scatter input)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.wire = 0.0  # bytes this rank sends with ring collectives, each over its own group
        self.wire_by_kind: dict[str, float] = {}  # the same per `collective_kind`
        self.gemm_flops: dict[tuple[int, int, int], int] = {}  # (m, k, n) -> FLOPs of the matmuls of that shape
        self.ops = 0  # aten ops dispatched (each costs host time, whatever its size)
        self.calls = 0  # collectives over more than one rank (each costs a round trip)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2], args[-1]
            shape = (int(a.shape[0]), int(a.shape[1]), int(b.shape[1]))
            self.gemm_flops[shape] = self.gemm_flops.get(shape, 0) + 2 * shape[0] * shape[1] * shape[2]
        self.ops += 1
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            name = func.__name__.split(".")[0].strip("_")
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            size = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.bytes[name] = self.bytes.get(name, 0) + size
            n = _group_size(leaves)
            self.calls += n > 1
            if n > 1:  # ring: all-reduce sends 2(n-1)/n of its buffer, the others (n-1)/n
                sent = size * (n - 1) / n * (2 if "reduce" in name and "scatter" not in name else 1)
                self.wire += sent
                kind = collective_kind(name)
                self.wire_by_kind[kind] = self.wire_by_kind.get(kind, 0.0) + sent
        return out


def _group_size(leaves: list) -> int:
    """The size of the process group a c10d op runs on: its ProcessGroup argument, or (functional collectives,
    e.g. tensor parallelism's) its group name."""
    for leaf in leaves:
        if isinstance(leaf, torch.ScriptObject):  # a boxed ProcessGroup (or ReduceOp) in the op's arguments
            try:
                return dist.ProcessGroup.unbox(leaf).size()
            except (RuntimeError, TypeError):
                continue
    for leaf in reversed(leaves):
        if isinstance(leaf, str):
            try:
                return dist.distributed_c10d._resolve_process_group(leaf).size()
            except (KeyError, ValueError, RuntimeError):
                continue
    return 1


@contextlib.contextmanager
def counting_selective_ops() -> Iterator[list[int]]:
    """Count the ops selective activation checkpointing's policy decides on (forward and recompute): each goes
    through its Python dispatch mode, a host cost the FLOPs do not show. Yields a one-element list."""
    from shardtrain.parallel import activation_checkpoint

    calls = [0]
    original = activation_checkpoint.selective_policy

    def counted() -> Callable:
        policy = original()

        def counting(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return policy(ctx, op, *args, **kwargs)
        return counting
    activation_checkpoint.selective_policy = counted
    try:
        yield calls
    finally:
        activation_checkpoint.selective_policy = original


class GlooCopies(TorchDispatchMode):
    """What a reduce-scatter on gloo allocates that the fake process group does not: a second input-sized buffer
    while it runs (seen at the peak of bf16 runs): the receive buffer of shardtrain's all-to-all reduce-scatter
    (`parallel/gloo_comms.py`, the default on gloo), or gloo's clone of its input
    (`ProcessGroupGloo::_reduce_scatter_base`, `SHARDTRAIN_GLOO_REDUCE_SCATTER=native`). Entered above the
    tracker, so the tracker counts it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func is torch.ops.c10d._reduce_scatter_base_.default:
            clone = torch.empty_like(args[1])
            out = func(*args, **kwargs)
            del clone
            return out
        return func(*args, **kwargs)


def flop_counter() -> FlopCounterMode:
    """PyTorch's FLOP counter, plus the kernels it has no formula for: the CPU flash-attention ones (SDPA on CPU,
    which the trace runs, would otherwise count no attention FLOPs; the formulas are PyTorch's own SDPA ones) and
    grouped matmuls."""
    from torch.utils import flop_counter

    from shardtrain.plan.experts import grouped_mm_flops

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001, ANN003
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad, query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001, ANN003
        return flop_counter.sdpa_backward_flop_count(grad, query, key, value)

    return FlopCounterMode(display=False, custom_mapping={
        aten._grouped_mm: grouped_mm_flops,  # the experts' matmuls (transformers' default experts implementation)
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward})


@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """DeviceMeshes made during the traced set-up (FSDP2 joins the dp and tp meshes of a tensor-parallel parameter)
    build their rank tables with real tensors: the active FakeTensorMode would intercept those ops and refuse the
    real table. Only mesh construction steps out of the fake mode; every parameter and activation stays fake."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)
    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


def step_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """PyTorch's `FSDPMemTracker`, with its post-backward wrapper fixed: PyTorch's keeps the last unsharded
    gradient it labelled in a local variable while the reduce-scatter runs, so a one-parameter unit (the
    embedding) would hold its full gradient twice at its reduce (+6 % on one rank); FSDP itself frees it after
    the copy into the reduce-scatter input."""
    from torch.distributed._tools import fsdp2_mem_tracker as fmt

    class Tracker(fmt.FSDPMemTracker):
        def _fsdp_param_group_post_backward(self, fsdp_mod: Any, orig: Callable) -> Callable:
            @functools.wraps(orig)
            def inner(*args: Any, **kwargs: Any) -> None:
                fsdp_state = fsdp_mod._get_fsdp_state()
                if group := fsdp_state._fsdp_param_group:
                    for fsdp_param in group.fsdp_params:
                        if fsdp_param._unsharded_param.grad is not None:
                            self._update_and_maybe_create_winfos(fsdp_param._unsharded_param.grad,
                                                                 fmt._FSDPRefType.UNSHARDED_GRAD,
                                                                 update_existing=True)
                mod_stat = self.memory_tracking[fsdp_mod]
                mod_stat.snapshots.setdefault(fmt._FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
                self._fsdp_state = fmt._FSDPState.POST_BW
                orig(*args, **kwargs)
                if group := fsdp_state._fsdp_param_group:
                    for fsdp_param in group.fsdp_params:
                        if fsdp_param.sharded_param.grad is not None:
                            self._update_and_maybe_create_winfos(fsdp_param.sharded_param.grad,
                                                                 fmt._FSDPRefType.SHARDED_GRAD)
                mod_stat.snapshots.setdefault(fmt._FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())
            return inner

    return Tracker(model, optimizer)
