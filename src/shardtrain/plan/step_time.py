"""Predicted step time: traced FLOPs / a compute rate + traced collective bytes / a link rate, per rank.

Rates come from flags (`--tflops`, `--link-gbps`) or from a short calibration on this machine (a matmul for the
compute rate; a large memory copy as a stand-in for the link, which says nothing about a real interconnect: pass
`--link-gbps` for that). The report says which.

    rates = Rates.resolve(tflops=None, link_gbps=400)   # compute rate measured here, link rate given
    estimate = step_time(trace, rates)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardtrain.errors import PlanError
from shardtrain.plan.trace import StepTrace

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # mixed precision -> matmul dtype; else fp32


def _timed(fn, min_seconds: float = 0.2) -> float:  # noqa: ANN001
    fn()  # warm-up (allocations, kernels)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


def measure_flops_rate(device: str = "cpu", gemm: tuple[int, int, int] = (512, 512, 512),
                       threads: int | None = None, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a (m x k) @ (k x n) matmul in `dtype` on `device` with `threads` CPU threads (the calibration of
    the compute rate: the step's own dominant matmul shape, in its compute dtype, on the threads one rank gets;
    a GPU's bf16 rate is many times its fp32 one)."""
    m, k, n = gemm
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    before = torch.get_num_threads()

    def run() -> None:
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
    try:
        if threads:
            torch.set_num_threads(threads)
        return 2 * m * k * n / _timed(run)
    finally:
        torch.set_num_threads(before)


def measure_copy_rate(device: str = "cpu", nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of a large tensor copy on `device`: a local stand-in for the link rate."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def run() -> None:
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
    return nbytes / _timed(run)


@dataclass(frozen=True)
class Rates:
    """Compute rate (FLOP/s) and link rate (bytes/s per rank), and where each came from."""

    flops_per_s: float
    link_bytes_per_s: float
    flops_source: str
    link_source: str

    @classmethod
    def resolve(cls, tflops: float | None = None, link_gbps: float | None = None, device: str = "cpu",
                gemm: tuple[int, int, int] | None = None, threads: int | None = None,
                dtype: torch.dtype = torch.float32, tflops_source: str | None = None,
                link_source: str | None = None) -> Rates:
        """Given rates win (named by `tflops_source` / `link_source`, e.g. an accelerator's datasheet); a missing
        one is measured here on `device` (the compute rate on the `gemm` shape in `dtype` with `threads` CPU
        threads).

        Raises:
            PlanError: a given rate <= 0.
        """
        for name, value in (("tflops", tflops), ("link_gbps", link_gbps)):
            if value is not None and value <= 0:
                raise PlanError(f"{name} = {value} must be > 0 (e.g. --tflops 400 --link-gbps 50)")
        if tflops is not None:
            flops, flops_source = tflops * 1e12, tflops_source or "given (--tflops)"
        else:
            shape = gemm or (512, 512, 512)
            flops = measure_flops_rate(device, shape, threads, dtype)
            m, k, n = shape
            flops_source = (f"measured here: {DTYPE_NAMES.get(dtype, dtype)} {m}x{k} @ {k}x{n} matmul (the step's "
                            f"largest by FLOPs) on {device}" + (f", {threads} thread(s)" if threads else ""))
        if link_gbps is not None:
            link, link_source = link_gbps * 1e9, link_source or "given (--link-gbps)"
        else:
            link = measure_copy_rate(device)
            link_source = f"measured here: memory copy on {device} (a stand-in; pass --link-gbps)"
        return cls(flops, link, flops_source, link_source)


def wire_bytes(trace: StepTrace) -> int:
    """Bytes one rank sends per step with ring collectives, each over the group it runs on (traced): (n-1)/n of
    each all-gather output and reduce-scatter input, 2(n-1)/n of each all-reduce (FSDP's shard group, HSDP's
    replicas, tensor parallelism's group)."""
    return trace.wire_bytes


DEFAULT_MFU = 0.4  # a dense transformer's step reaches 35-45 % of a GPU's datasheet peak (`--mfu`)


def step_time(trace: StepTrace, rates: Rates, mfu: float = 1.0) -> dict:
    """Seconds per step: compute, communication, their sum (no overlap) and their max (full overlap), at the full
    compute rate (a floor) and at `mfu` of it (the share of the rate a real step reaches)."""
    if not 0 < mfu <= 1:
        raise PlanError(f"mfu = {mfu}: give the share of the compute rate a step reaches, in (0, 1] (e.g. 0.4)")
    compute = trace.flops / rates.flops_per_s
    sent = wire_bytes(trace)
    comm = sent / rates.link_bytes_per_s
    return {"flops": trace.flops, "collective_bytes": dict(trace.collective_bytes), "wire_bytes": sent,
            "compute_s": compute, "comm_s": comm, "step_s_no_overlap": compute + comm,
            "step_s_full_overlap": max(compute, comm), "flops_rate": rates.flops_per_s,
            "flops_rate_source": rates.flops_source, "link_rate": rates.link_bytes_per_s,
            "link_rate_source": rates.link_source, "mfu": mfu, "compute_s_at_mfu": compute / mfu,
            "step_s_at_mfu_no_overlap": compute / mfu + comm, "step_s_at_mfu_full_overlap": max(compute / mfu, comm)}
