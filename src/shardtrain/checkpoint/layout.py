"""The checkpoint layout: one source of truth for every module that writes or reads a checkpoint.

    output_dir/checkpoint-<step>/   (written as .tmp-checkpoint-<step>/, renamed when complete)
        sharded/                    DCP model (+ optimizer) shards   (SHARDED_STATE_DICT)
        model.safetensors           full model                       (FULL_STATE_DICT)
        optimizer/                  DCP optimizer state              (FULL_STATE_DICT)
        trainer_state.json, scheduler.json, tied_weights.json, rng_state_<rank>.pt, manifest.json, config.json
        base_model.json             adapter (LoRA) checkpoints: class and hash of the frozen base (not saved)
"""

import re
from pathlib import Path

from shardtrain.errors import CheckpointError

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
SHARDED_DIR = "sharded"
OPTIMIZER_DIR = "optimizer"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.json"
TIED_FILE = "tied_weights.json"
RNG_PREFIX = "rng_state_"
BASE_FILE = "base_model.json"  # adapter checkpoints: the frozen base they were trained on
NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoint_kind(path: Path) -> str:
    """"SHARDED_STATE_DICT" or "FULL_STATE_DICT" from the files present."""
    if (path / SHARDED_DIR).is_dir():
        return "SHARDED_STATE_DICT"
    if (path / MODEL_FILE).is_file() or (path / MODEL_INDEX_FILE).is_file():
        return "FULL_STATE_DICT"
    raise CheckpointError(f"{path} holds no model (no sharded/ and no model.safetensors); pass a checkpoint-<step> "
                          "directory written by shardtrain")
