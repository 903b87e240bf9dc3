"""The step guard: a step whose global loss or gradient norm is not finite (and, opt-in, one whose loss spikes) is
skipped on every rank together, its batch recorded so that no resume feeds it again.

    TrainingArguments(..., step_guard=True)                                   # non-finite steps only
    TrainingArguments(..., step_guard={"spike_factor": 10, "window": 20, "max_in_a_row": 3})

The decision reads two all-reduced numbers, the step's global mean loss and its global gradient norm, so every rank
takes the same one. A skipped step makes no optimizer and no scheduler step, drops its gradients and is not
counted in `global_step`; the data moves on to the next batch. After `max_in_a_row` skips in a row the run stops
with `StepGuardError` and the last checkpoint as it was.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtrain.errors import StepGuardError, TrainingArgumentsError

SKIP_RECORD_FILE = "skipped_batches.json"  # in output_dir: every skipped batch, written at the skip (rank 0)


@dataclass(frozen=True, kw_only=True)
class StepGuardConfig:
    """`TrainingArguments.step_guard`, resolved once.

    Attributes:
        spike_factor: also skip a step whose loss exceeds this times the median of the last `window` kept steps'
            losses (None: non-finite steps only).
        window: kept steps the median is taken over; the spike test starts once that many were kept.
        max_in_a_row: this many skipped steps in a row stop the run.
    """

    spike_factor: float | None = None
    window: int = 20
    max_in_a_row: int = 3

    @classmethod
    def from_setting(cls, value: Any) -> StepGuardConfig | None:
        """None/False: no guard; True: the defaults; a dict: those keys.

        Raises:
            TrainingArgumentsError: an unknown key or a value out of range, named with the fix.
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, dict):
            raise TrainingArgumentsError(f"TrainingArguments.step_guard got {value!r}; use true, or a dict with keys "
                                         f"spike_factor, window, max_in_a_row")
        unknown = sorted(set(value) - {"spike_factor", "window", "max_in_a_row"})
        if unknown:
            raise TrainingArgumentsError(f"TrainingArguments.step_guard has unknown keys {unknown}; allowed: "
                                         f"spike_factor, window, max_in_a_row")
        config = cls(**value)
        factor = config.spike_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or
                                   not math.isfinite(factor) or factor <= 1):
            raise TrainingArgumentsError(f"TrainingArguments.step_guard spike_factor = {factor!r} must be a number "
                                         f"> 1 (a loss that many times the recent median is a spike), or null")
        for key in ("window", "max_in_a_row"):
            number = getattr(config, key)
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise TrainingArgumentsError(f"TrainingArguments.step_guard {key} = {number!r} must be an int >= 1")
        return config


@dataclass(kw_only=True)
class StepGuard:
    """The guard of one run: the recent kept losses, the skips in a row, and the record of skipped batches."""

    config: StepGuardConfig
    history: deque  # the last `config.window` kept losses (a deque with that maxlen)
    in_a_row: int = 0

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why the step must be skipped, or None (the same on every rank: both numbers are global)."""
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"the gradient norm is {grad_norm}"
        factor = self.config.spike_factor
        if factor is not None and len(self.history) >= self.config.window:
            median = statistics.median(self.history)
            if loss > factor * median:
                return f"the loss {loss:.4g} is over {factor:g} x the median {median:.4g} of the last " \
                       f"{self.config.window} steps"
        return None

    def kept(self, loss: float) -> None:
        """A step that was applied: its loss joins the window (`history` keeps the last `window`); the run of skips
        ends."""
        self.in_a_row = 0
        self.history.append(loss)

    def skipped(self, step: int, reason: str, last_checkpoint: str | None) -> None:
        """Count a skip.

        Raises:
            StepGuardError: `max_in_a_row` skips in a row (on every rank: the decisions are the same).
        """
        self.in_a_row += 1
        if self.in_a_row >= self.config.max_in_a_row:
            kept = f"the last checkpoint ({last_checkpoint}) is intact" if last_checkpoint else "no checkpoint was " \
                "written yet"
            raise StepGuardError(
                f"step_guard: {self.in_a_row} steps in a row were skipped at step {step + 1} ({reason}); stopping, "
                f"{kept}. Look at the batches in output_dir/{SKIP_RECORD_FILE}, lower the learning rate, or raise "
                f"step_guard max_in_a_row")

    def state(self) -> list[float]:
        """What a checkpoint keeps: the window of kept losses."""
        return list(self.history)


@dataclass(kw_only=True)
class GuardedRun:
    """The Trainer's side of the guard: which batches are recorded as skipped (this run's checkpoint state and
    `output_dir/skipped_batches.json`, written at each skip), and what a skip changes in the `TrainerState`.

    A resume, on any world size, passes over a recorded batch without feeding it: positions are (pass, step of
    the pass) of the global batch plan, which the layout does not change.
    """

    guard: StepGuard
    record_file: Path
    rank: int
    recorded: set[tuple[int, int]] = field(default_factory=set)

    @classmethod
    def start(cls, setting: Any, state: Any, output_dir: str, *, resuming: bool, rank: int) -> GuardedRun | None:
        """The guard of a run (None when `step_guard` is off); a resume reads the batches skipped after its
        checkpoint from the record file, a fresh run starts the file anew."""
        config = StepGuardConfig.from_setting(setting)
        if config is None:
            return None
        record_file = Path(output_dir) / SKIP_RECORD_FILE
        history = deque(state.guard_window, maxlen=config.window)
        run = cls(guard=StepGuard(config=config, history=history), record_file=record_file, rank=rank)
        entries = list(state.skipped_batches)
        if resuming and record_file.is_file():
            entries += json.loads(record_file.read_text())
        elif not resuming and rank == 0 and record_file.is_file():
            record_file.unlink()  # a previous run's record; this run writes its own
        run.recorded = {(int(e["epoch"]), int(e["data_step"])) for e in entries}
        return run

    def is_recorded(self, epoch: int, step: int) -> bool:
        """Whether the batch at (pass, step) was skipped before (it is passed over, not fed)."""
        return (epoch, step) in self.recorded

    def pass_recorded(self, state: Any, epoch: int, step: int) -> None:
        """Pass over a recorded batch: counted as skipped again in this lineage's state, not fed to the model."""
        state.skipped_steps += 1
        if not any((e["epoch"], e["data_step"]) == (epoch, step) for e in state.skipped_batches):
            state.skipped_batches.append({"step": state.global_step + 1, "epoch": epoch, "data_step": step,
                                          "reason": "recorded by an earlier attempt", "samples": None})

    def skip(self, state: Any, reason: str, epoch: int, step: int, samples: list[int] | None) -> str:
        """Record a skipped step (state, record file) and return its warning line (then `guard.skipped` counts
        it, and stops the run after too many in a row)."""
        entry = {"step": state.global_step + 1, "epoch": epoch, "data_step": step, "reason": reason,
                 "samples": samples}
        state.skipped_steps += 1
        state.skipped_batches.append(entry)
        self.recorded.add((epoch, step))
        if self.rank == 0:
            self._write([*self._written(), entry])
        shown = "" if samples is None else f"; samples {samples[:16]}" + (" ..." if len(samples) > 16 else "")
        return (f"step_guard: skipped step {state.global_step + 1} (pass {epoch}, batch {step}): {reason}; no "
                f"update, its batch is recorded in {self.record_file}{shown}")

    def _written(self) -> list[dict]:
        try:
            return json.loads(self.record_file.read_text()) if self.record_file.is_file() else []
        except (OSError, ValueError):
            return []

    def _write(self, entries: list[dict]) -> None:
        self.record_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.record_file.with_name(self.record_file.name + ".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, self.record_file)
