"""Rank-0 reporting: metrics.jsonl and TensorBoard (`MetricsLogger`). What is shown while training is Hugging
Face's own `ProgressCallback` (or `PrinterCallback` with `disable_tqdm`), which the Trainer adds as Hugging Face's
does; `trainer.remove_callback(ProgressCallback)` silences it, and metrics.jsonl is always written."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import TrainerCallback

from shardtrain.errors import TrainingArgumentsError


def memory_kind() -> str:
    """What `peak_memory_mb` measures: "cuda_max_allocated" (allocator high-water mark) or "cpu_peak_rss"."""
    return "cuda_max_allocated" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu_peak_rss"


def peak_memory_mb() -> float:
    """Peak resident memory of this process (CPU), or peak allocated GPU memory, in MiB."""
    if memory_kind() == "cuda_max_allocated":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scalar_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """A log entry as trackers take it: numbers only; a list of numbers (peak memory per rank) becomes one key
    per element (`peak_memory_mb_per_rank_0`, ...); text (`memory_kind`) is left out."""
    out: dict[str, Any] = {}
    for key, value in logs.items():
        if key == "step":  # metrics.jsonl's; trackers take the step from TrainerState, as for Hugging Face
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
            out.update({f"{key}_{i}": v for i, v in enumerate(value)})
    return out


def rank0_trackers(report_to: list[str], rank: int) -> list[TrainerCallback]:
    """`tracker_callbacks` on rank 0 (none elsewhere); a tracker that cannot start raises on every rank."""
    from shardtrain.parallel.collectives import agree

    problem, trackers = None, []
    try:
        trackers = tracker_callbacks(report_to) if rank == 0 else []
    except TrainingArgumentsError as err:
        problem = str(err)
    agree(problem, TrainingArgumentsError)
    return trackers


def tracker_callbacks(report_to: list[str]) -> list[TrainerCallback]:
    """transformers' integration callbacks for `report_to` (Weights & Biases, MLflow, Trackio, TensorBoard, ...),
    each fed `scalar_logs` of every entry so that none warns about shardtrain's list- and text-valued keys.

    Raises:
        TrainingArgumentsError: an integration's package is missing (the message names it and the pip fix).
    """
    from transformers.integrations import get_reporting_integration_callbacks

    callbacks = []
    for cls in get_reporting_integration_callbacks(report_to):
        def on_log(self, args, state, control, logs=None, _cls=cls, **kwargs):  # noqa: ANN001
            return _cls.on_log(self, args, state, control, logs=scalar_logs(logs or {}), **kwargs)

        scalar_cls = type(cls.__name__, (cls,), {"on_log": on_log, "__doc__": cls.__doc__})
        try:
            callbacks.append(scalar_cls())
        except (RuntimeError, ImportError) as err:
            raise TrainingArgumentsError(f"TrainingArguments.report_to includes {cls.__name__}'s integration, "
                                         f"which cannot start: {err}; install its package or drop it from "
                                         "report_to") from None
    return callbacks


# what a log entry measures rather than computes (it differs between two runs of the same job)
MEASURED_KEYS = frozenset({"tokens_per_second", "peak_memory_mb", "peak_memory_mb_per_rank", "memory_kind"})


class MetricsLogger:
    """Writes every log entry to `output_dir/metrics.jsonl` on rank 0 (trackers are transformers' integration
    callbacks: `tracker_callbacks`), and measures tokens per second."""

    def __init__(self, output_dir: str | Path, is_main: bool) -> None:
        self.output_dir, self.is_main = Path(output_dir), is_main
        self.tokens = self.tokens_at_start = 0
        self.started = time.perf_counter()
        self.last_logs: dict[str, Any] = {}
        self.report_drawn = False  # a training run drew report.png: later evaluations are added to it

    def start(self, step: int, max_steps: int, tokens_seen: int) -> None:
        self.tokens_at_start, self.tokens, self.started = tokens_seen, tokens_seen, time.perf_counter()

    @property
    def tokens_per_second(self) -> float:
        return (self.tokens - self.tokens_at_start) / max(time.perf_counter() - self.started, 1e-9)

    def step_done(self, tokens_seen: int) -> None:
        self.tokens = tokens_seen

    def log(self, entry: dict[str, Any]) -> None:
        self.last_logs.update(entry)
        if not self.is_main:
            return
        path = self.output_dir / "metrics.jsonl"  # always written, whatever report_to says
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop metrics.jsonl lines of steps after `step`: a resumed run logs those steps again."""
        truncate_jsonl(self.output_dir / "metrics.jsonl", step)

    def throughput_and_memory(self, all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
                              device: torch.device) -> dict[str, Any]:
        """Tokens/s since `start`, and every rank's peak memory (collective: one small all-gather)."""
        mine = torch.tensor([peak_memory_mb()], dtype=torch.float64, device=device)
        per_rank = [round(float(t), 1) for t in all_gather(mine)]
        return {"tokens_per_second": round(self.tokens_per_second, 1), "peak_memory_mb": max(per_rank),
                "peak_memory_mb_per_rank": per_rank, "memory_kind": memory_kind()}

    def draw_report(self) -> None:
        """output_dir/report.png from metrics.jsonl (rank 0, when matplotlib is installed)."""
        if not self.is_main:
            return
        from shardtrain.train.metrics.chart import draw_report

        try:
            draw_report(self.output_dir / "metrics.jsonl", self.output_dir / "report.png")
        except ImportError:
            return  # matplotlib is an extra: pip install 'shardtrain[report]'
        self.report_drawn = True

    def close(self) -> None:
        return None


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the lines of a JSON-lines file whose "step" is at most `step` (a line cut short by a crash goes too),
    replacing the file atomically; a missing file stays missing."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)
