"""Profilers for `worker.py`'s timed steps on rank 0: torch.profiler / cProfile (`Profiler`) and per-stage
wall time, CPU time and page faults (`StageMeter`)."""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class Profiler:
    """Optional profiling of the timed steps on rank 0: torch.profiler or cProfile."""

    def __init__(self, kind: str, out: Path, rank: int, steps: int) -> None:
        self.kind = kind if rank == 0 else "none"
        self.out, self.steps = out, steps
        self.torch_prof: torch.profiler.profile | None = None
        self.cprof: cProfile.Profile | None = None

    def start(self) -> None:
        if self.kind == "torch":
            self.torch_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                     record_shapes=False)
            self.torch_prof.__enter__()
        elif self.kind == "cprofile":
            # CPU time, not wall time: attributes work, not waiting (and is less skewed by other load)
            self.cprof = cProfile.Profile(time.process_time)
            self.cprof.enable()

    def stop(self) -> None:
        if self.torch_prof is not None:
            self.torch_prof.__exit__(None, None, None)
            averages = self.torch_prof.key_averages()
            table = averages.table(sort_by="self_cpu_time_total", row_limit=40)
            Path(f"{self.out}.profile.txt").write_text(
                f"# torch.profiler key_averages, rank 0, {self.steps} timed steps (divide totals by it)\n{table}\n")
            rows = [{"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
                     "cpu_us": e.cpu_time_total} for e in averages]
            Path(f"{self.out}.profile.json").write_text(json.dumps({"steps": self.steps, "ops": rows}))
            self.torch_prof = None
        if self.cprof is not None:
            self.cprof.disable()
            buf = io.StringIO()
            stats = pstats.Stats(self.cprof, stream=buf)
            buf.write(f"# cProfile (CPU time), rank 0, {self.steps} timed steps (divide times by it)\n")
            stats.sort_stats("cumulative").print_stats(70)
            stats.sort_stats("tottime").print_stats(40)
            stats.dump_stats(f"{self.out}.pstats")
            Path(f"{self.out}.cprofile.txt").write_text(buf.getvalue())
            self.cprof = None


class StageMeter:
    """`--profile stages`: wall time, user / system CPU and minor page faults of each stage of a step (rank 0).

    Stages are timed with `with meter("name"):` in the raw loop, or by wrapping the Trainer's callees.
    """

    def __init__(self, enabled: bool, out: Path) -> None:
        self.enabled, self.out = enabled, out
        self.active = False
        self.samples: dict[str, list[tuple[float, float, float, float]]] = {}

    @staticmethod
    def _now() -> tuple[float, float, float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), usage.ru_utime, usage.ru_stime, float(usage.ru_minflt)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not (self.enabled and self.active):
            yield
            return
        before = self._now()
        try:
            yield
        finally:
            after = self._now()
            self.samples.setdefault(name, []).append(tuple(b - a for a, b in zip(before, after, strict=True)))

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Replace `owner.attr` by a timed call (class or instance attribute)."""
        original = getattr(owner, attr)
        meter = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            with meter(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)

    def write(self, steps: int) -> None:
        if not self.enabled:
            return
        rows = {}
        for name, values in self.samples.items():
            per_step = len(values) / max(steps, 1)
            rows[name] = {"calls_per_step": round(per_step, 2),
                          **{f"{key}_per_step": round(sum(v[i] for v in values) / max(steps, 1) * scale, 2)
                             for i, (key, scale) in enumerate((("wall_ms", 1e3), ("user_ms", 1e3), ("sys_ms", 1e3),
                                                                ("minor_faults", 1)))}}
        Path(f"{self.out}.stages.json").write_text(json.dumps({"steps": steps, "stages": rows}, indent=1))
