"""Trainer state, control flags and callbacks: transformers' own classes, so callbacks written for Hugging Face's
Trainer (`EarlyStoppingCallback`, ...) work unchanged; the Trainer's `callback_handler` is transformers' own.

`TrainerState` adds what an exact resume needs (the batch plan and the data position) to Hugging Face's dataclass.
`trainer_state.json` stays Hugging Face's own file (`transformers.TrainerState.load_from_json` reads it); those
fields go beside it, into `shardtrain_state.json` (`ENGINE_STATE_FILE`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl
from transformers import TrainerState as _HFTrainerState
from transformers.trainer_callback import ExportableState

from shardtrain.checkpoint.layout import ENGINE_STATE_FILE, STATE_FILE

__all__ = ["TrainerCallback", "TrainerControl", "TrainerState"]


@dataclass
class TrainerState(_HFTrainerState):
    """Progress of a run (Hugging Face's fields) plus the batch plan a resume must match."""

    steps_per_epoch: int = 0  # 0: a stream (its passes have no known length)
    global_batch_size: int = 0
    data_epoch: int = 0  # where the data stands after global_step: the pass and the steps taken in it
    data_step: int = 0
    skipped_steps: int = 0  # steps the step guard skipped (not counted in global_step; their batches were used up)
    skipped_batches: list = field(default_factory=list)  # each: step, epoch, data_step, reason, samples
    guard_window: list = field(default_factory=list)  # the step guard's recent kept losses (its spike median)
    lost_slots: list = field(default_factory=list)  # replica groups, lost_batches "refeed": [epoch, step, group]
    # of the shares of steps a dead group did not train, still to be given to a later step

    @classmethod
    def engine_fields(cls) -> set[str]:
        """The fields shardtrain adds to Hugging Face's state (saved in `ENGINE_STATE_FILE`)."""
        return {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(_HFTrainerState)}

    def save_to_json(self, json_path: str | Path) -> None:
        """Hugging Face's `trainer_state.json`: its fields only, as `transformers.TrainerState` writes them."""
        extra = self.engine_fields()
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in extra}
        Path(json_path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    def save(self, directory: str | Path) -> None:
        """Write `trainer_state.json` and `shardtrain_state.json` (the engine's fields) into `directory`."""
        directory = Path(directory)
        self.save_to_json(directory / STATE_FILE)
        engine = {name: getattr(self, name) for name in sorted(self.engine_fields())}
        (directory / ENGINE_STATE_FILE).write_text(json.dumps(engine, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def store_callback_states(state: TrainerState, stateful: list[Any]) -> None:
    """Hugging Face's: the state of every `ExportableState` among `stateful` (callbacks, and the control) into
    `state.stateful_callbacks`, which `trainer_state.json` saves and a resume restores (several of one class: a
    list, in order)."""
    for callback in stateful:
        if isinstance(callback, ExportableState):
            name, saved = type(callback).__name__, callback.state()
            if isinstance(state.stateful_callbacks.get(name), list):
                state.stateful_callbacks[name].append(saved)
            else:
                state.stateful_callbacks[name] = saved
