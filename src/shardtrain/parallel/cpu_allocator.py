"""glibc malloc settings for CPU training: keep FSDP's big buffers instead of returning them to the kernel.

    SHARDTRAIN_CPU_ALLOCATOR=default shardtrain launch --cpu ...   # leave glibc's own behaviour

FSDP gathers every unit into a fresh buffer and frees it soon after (up to 131 MB on the 50M benchmark model).
glibc serves allocations above its mmap threshold (128 KiB, rising to at most 32 MiB) with `mmap` and unmaps
them on free, so every step faults hundreds of thousands of pages back in: about a third of a 50M step was
system time (benchmarks/README.md). `tune_cpu_allocator` raises the mmap threshold to 256 MiB and the trim
threshold to 512 MiB with `mallopt`, the same as `MALLOC_MMAP_THRESHOLD_=268435456
MALLOC_TRIM_THRESHOLD_=536870912`, so freed buffers are reused.
It also limits malloc to one arena (`M_ARENA_MAX` 1, as `MALLOC_ARENA_MAX=1`): gloo's worker threads allocate
the all-gather's flat buffer (65 MB for the 50M model's head), and a thread arena serves anything above its 64 MiB
heap with `mmap`, whatever the threshold, so it was unmapped and faulted in again every step; in the main arena it
is reused: page faults 8 k -> 4 k, system time 132 -> 106 ms per step. It is set before the process group starts
gloo's threads. Together, on a 2-rank 50M step: 1256 -> 762 ms, page faults 192 k -> 4 k per step, for +0.4-0.5
GiB peak RSS per rank (benchmarks/results/cpu_efficiency.json, benchmarks/README.md).
`init_distributed` calls it on CPU runs however they are started (launch, torchrun, plain python). It does
nothing when the user set glibc's own settings (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
`MALLOC_ARENA_MAX`, `glibc.malloc.*` in `GLIBC_TUNABLES`: theirs win), with `SHARDTRAIN_CPU_ALLOCATOR=default`,
or without glibc (musl, macOS). GPU runs are untouched: the CUDA caching allocator already keeps its memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

from shardtrain.config import env

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameter numbers
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20
ARENA_MAX = 1
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")
CHOICES = ("tuned", "default")

_applied: dict[str, int] | None = None


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt(param, value)` (returns 1 on success), or None without glibc."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None


def tune_cpu_allocator() -> dict[str, int] | None:
    """Apply the settings once per process; returns what was set, or None when left alone.

    Raises:
        env.EnvError: SHARDTRAIN_CPU_ALLOCATOR is neither "tuned" nor "default".
    """
    global _applied
    choice = os.environ.get(env.CPU_ALLOCATOR, "tuned").strip().lower() or "tuned"
    if choice not in CHOICES:
        raise env.EnvError(f"environment variable {env.CPU_ALLOCATOR}={choice!r} is not one of {list(CHOICES)}; "
                           "unset it (tuned) or set it to 'default' to keep glibc's own malloc behaviour")
    users = any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    if _applied is not None or choice == "default" or users:
        return _applied
    mallopt = glibc_mallopt()
    if mallopt is None:  # not glibc
        return None
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and \
            mallopt(M_ARENA_MAX, ARENA_MAX):
        _applied = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD, "arena_max": ARENA_MAX}
    return _applied
