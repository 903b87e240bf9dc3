"""Trainer state (what `trainer_state.json` holds) and the callback protocol, as in Hugging Face."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainerState:
    """Progress of a run; saved with every checkpoint so a resume continues exactly where it stopped."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    steps_per_epoch: int = 0
    global_batch_size: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_model_checkpoint: str | None = None
    num_input_tokens_seen: int = 0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class TrainerControl:
    """Flags a callback may set to steer the loop."""

    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False


class TrainerCallback:
    """Override any hook; each gets (args, state, control, **kwargs) like Hugging Face callbacks."""

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102
        pass

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        pass

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D102
        pass

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # noqa: D102
        pass

    def on_save(self, args, state, control, **kwargs):  # noqa: D102
        pass

    def on_train_end(self, args, state, control, **kwargs):  # noqa: D102
        pass
