"""What a rank's step costs on this machine, measured at start-up for `plan.auto_layout`: the compute rate, the link
(a real collective's rate and round trip) and the host time per op, plainly and under selective checkpointing.

    link, round_trip = measure_link(device)          # collective: every rank calls it; bytes/s per kind
    per_op, per_selective_op = measure_host(device)
    rates = Rates(compute_rate(gemm, device), link["allgather"], round_trip, per_op, per_selective_op,
                  link_by_kind=link)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Rates:
    """What one rank does per second (compute, link) and costs per call (collective round trip, host per op)."""

    flops_per_s: float
    link_bytes_per_s: float
    s_per_collective: float = 0.0
    s_per_op: float = 0.0
    s_per_selective_op: float = 0.0
    link_by_kind: dict[str, float] = field(default_factory=dict)  # measured per collective kind

    def link_rate(self, kind: str) -> float:
        """Bytes/s for a collective kind (`plan.trace_modes.COLLECTIVE_KINDS`); the all-gather's for others."""
        return self.link_by_kind.get(kind, self.link_bytes_per_s)


def _best_time(fn: Any, repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_link(device: torch.device, nbytes: int = 16 * 2**20) -> tuple[dict[str, float], float]:
    """Bytes/s one rank sends in real collectives on the default group, per kind (all-gather; reduce-scatter as
    FSDP2 runs it on this backend; all-reduce), and seconds per call (a tiny all-gather's round trip). Every rank
    must call it."""
    import torch.distributed as dist

    from shardtrain.parallel.gloo_comms import AllToAllReduceScatter

    world = dist.get_world_size()
    if world == 1:
        return {}, 0.0
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name (torch 2.13)
    gloo = dist.get_backend() == "gloo"

    def timed(kind: str, numel: int) -> float:
        shard = torch.ones(numel, dtype=torch.float32, device=device)
        full = torch.ones(numel * world, dtype=torch.float32, device=device)
        group = dist.group.WORLD
        calls = {"allgather": lambda: gather(full, shard),
                 "reduce_scatter": (lambda: AllToAllReduceScatter()(shard, full, group, dist.ReduceOp.SUM)) if gloo
                 else (lambda: dist.reduce_scatter_tensor(shard, full)),
                 "allreduce": lambda: dist.all_reduce(full)}

        def run() -> None:
            calls[kind]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return _best_time(run, repeats=6)
    round_trip = timed("allgather", 8)
    numel = nbytes // world // 4
    sent = numel * 4 * (world - 1)  # ring: (n-1)/n of the full buffer; all-reduce twice that
    rates: dict[str, float] = {}
    for _ in range(2):  # the first round also warms up the backend's buffers for this size
        for kind in ("allgather", "reduce_scatter", "allreduce"):
            rate = sent * (2 if kind == "allreduce" else 1) / max(timed(kind, numel) - round_trip, 1e-9)
            rates[kind] = max(rates.get(kind, 0.0), rate)
    return rates, round_trip


def measure_host(device: torch.device) -> tuple[float, float]:
    """(seconds per op, extra seconds per op under selective checkpointing's policy): a chain of small layer-like
    ops, forward and backward, timed plainly and under `torch.utils.checkpoint` with the selective policy."""
    from torch.utils.checkpoint import checkpoint

    from shardtrain.parallel.activation_checkpoint import selective_context
    from shardtrain.plan.trace_modes import CollectiveCounter, counting_selective_ops

    weight = torch.randn(16, 16, device=device, requires_grad=True)

    def layers(x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            x = x + torch.nn.functional.silu(h @ weight) * (h @ weight.t())
        return x

    def plain() -> None:
        layers(torch.randn(4, 16, device=device)).sum().backward()

    def selective() -> None:
        x = torch.randn(4, 16, device=device)
        checkpoint(layers, x, use_reentrant=False, context_fn=selective_context).sum().backward()

    counts = []
    for fn in (plain, selective):
        with CollectiveCounter() as counter, counting_selective_ops() as policy_calls:
            fn()
        counts.append((counter.ops, policy_calls[0]))
    per_op = _best_time(plain) / counts[0][0]
    extra = (_best_time(selective) - counts[1][0] * per_op) / max(counts[1][1], 1)
    return per_op, max(extra, 0.0)


def compute_rate(gemm: tuple[int, int, int] | None, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> float:
    """The compute rate `plan` calibrates: a matmul on the step's largest shape in its compute dtype, on this
    rank's threads."""
    from shardtrain.plan.step_time import measure_flops_rate

    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or None
    return measure_flops_rate("cuda" if device.type == "cuda" else "cpu", gemm or (512, 512, 512),
                              threads if device.type == "cpu" else None, dtype)

