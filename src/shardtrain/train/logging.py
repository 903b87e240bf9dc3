"""Rank-0 reporting: metrics.jsonl and TensorBoard (`MetricsLogger`), and what is shown while training, as the
progress callback Hugging Face's Trainer adds: `JsonProgressCallback` (a `ProgressCallback`: a bar on a terminal,
one JSON line per log entry) or, with `disable_tqdm`, `JsonPrinterCallback` (a `PrinterCallback`). Removing
them with `trainer.remove_callback(ProgressCallback)` silences the display; metrics.jsonl is always written."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from shardtrain.train.arguments import TrainingArguments


def memory_kind() -> str:
    """What `peak_memory_mb` measures: "cuda_max_allocated" (allocator high-water mark) or "cpu_peak_rss"."""
    return "cuda_max_allocated" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu_peak_rss"


def peak_memory_mb() -> float:
    """Peak resident memory of this process (CPU), or peak allocated GPU memory, in MiB."""
    if memory_kind() == "cuda_max_allocated":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MetricsLogger:
    """Writes every log entry to `output_dir/metrics.jsonl` (and TensorBoard) on rank 0, drives the bar."""

    def __init__(self, args: TrainingArguments, is_main: bool) -> None:
        self.args, self.is_main = args, is_main
        self.writer = None
        self.tokens = self.tokens_at_start = 0
        self.started = time.perf_counter()
        self.last_logs: dict[str, Any] = {}
        if is_main and "tensorboard" in args.report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("report_to includes 'tensorboard' but the tensorboard package is missing; "
                                  "pip install tensorboard, or drop it from report_to") from err
            self.writer = SummaryWriter(log_dir=str(Path(args.output_dir) / "runs"))

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
        path = Path(self.args.output_dir) / "metrics.jsonl"  # always written, whatever report_to says
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
        if self.writer is not None:
            for key, value in entry.items():
                if key not in ("step", "epoch") and isinstance(value, int | float):
                    self.writer.add_scalar(key, value, entry["step"])

    def truncate_after(self, step: int) -> None:
        """Drop metrics.jsonl lines of steps after `step`: a resumed run logs those steps again."""
        path = Path(self.args.output_dir) / "metrics.jsonl"
        if not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:
                continue  # a line cut short by a crash
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()


class JsonPrinterCallback(PrinterCallback):
    """Prints each log entry as one JSON line on the world's process zero."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs is not None:
            print(json.dumps(logs), flush=True)


class JsonProgressCallback(ProgressCallback):
    """A training bar when stderr is a terminal (not in CI or log files), and each log entry as a JSON line."""

    def __init__(self) -> None:
        super().__init__()
        self.bar: tqdm | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and sys.stderr.isatty():
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_prediction_step(self, args: Any, state: Any, control: Any, eval_dataloader: Any = None,
                           **kwargs: Any) -> None:
        return None

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        return None

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        return None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or logs is None:
            return
        line = json.dumps(logs)
        if self.bar is not None:
            postfix = {k: f"{logs[k]:.4g}" for k in ("loss", "learning_rate") if isinstance(logs.get(k), float)}
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.write(line)
        else:
            print(line, flush=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
