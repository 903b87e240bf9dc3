"""Trainer state, control flags and callbacks: transformers' own classes, so callbacks written for Hugging Face's
Trainer (`EarlyStoppingCallback`, ...) work unchanged.

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

__all__ = ["TrainerCallback", "TrainerControl", "TrainerState", "CallbackHandler"]


@dataclass
class TrainerState(_HFTrainerState):
    """Progress of a run (Hugging Face's fields) plus the batch plan a resume must match."""

    steps_per_epoch: int = 0
    global_batch_size: int = 0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class CallbackHandler:
    """Calls every callback's `on_<event>(args, state, control, **kwargs)`; a returned control replaces it."""

    def __init__(self, callbacks: list[TrainerCallback]) -> None:
        self.callbacks: list[TrainerCallback] = []
        for callback in callbacks:
            self.add(callback)

    def add(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        for existing in self.callbacks:
            if existing is callback or (isinstance(callback, type) and isinstance(existing, callback)):
                self.callbacks.remove(existing)
                return existing
        return None

    def remove(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.pop(callback)

    def fire(self, event: str, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> \
            TrainerControl:
        for callback in self.callbacks:
            result = getattr(callback, event, None)
            if result is None:
                continue
            result = result(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control
