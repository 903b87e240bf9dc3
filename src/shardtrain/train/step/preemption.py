"""SIGTERM (what schedulers send before they kill a preempted job): finish the step, checkpoint, exit 143.

The handler only records the request. The next optimizer step's first all-reduce (the global target-token
count, `Trainer._global_items`) carries every rank's flag, so all ranks see the request at the same step,
whichever rank received the signal and whenever: each raises `Preempted` before that step's forward, the
Trainer writes a checkpoint of the last finished step and exits 143 (128 + SIGTERM), and a restart (torchrun's
`--max_restarts`, or the scheduler's) resumes from it exactly.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

EXIT_CODE = 128 + signal.SIGTERM  # 143: what a process killed by SIGTERM reports, as schedulers expect


class Preempted(Exception):
    """Raised on every rank at the step boundary after a SIGTERM reached any rank."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted (SIGTERM) after step {step}")
        self.step = step


class PreemptionHandler:
    """Records SIGTERM while `train()` runs (the main thread's handler is restored afterwards)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
