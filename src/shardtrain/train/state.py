"""Trainer state, control flags and callbacks: transformers' own classes, so callbacks written for Hugging Face's
Trainer (`EarlyStoppingCallback`, ...) work unchanged; the Trainer's `callback_handler` is transformers' own.

`TrainerState` adds what an exact resume needs (`steps_per_epoch`, `global_batch_size`) to Hugging Face's
dataclass; `trainer_state.json` is Hugging Face's file with those two keys more.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl
from transformers import TrainerState as _HFTrainerState

__all__ = ["TrainerCallback", "TrainerControl", "TrainerState"]


@dataclass
class TrainerState(_HFTrainerState):
    """Progress of a run (Hugging Face's fields) plus the batch plan a resume must match."""

    steps_per_epoch: int = 0  # 0: a stream (its passes have no known length)
    global_batch_size: int = 0
    data_epoch: int = 0  # where the data stands after global_step: the pass and the steps taken in it
    data_step: int = 0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
