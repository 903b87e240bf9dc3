"""The checkpoint layout: one source of truth for every module that writes or reads a checkpoint.

    output_dir/checkpoint-<step>/   (written as .tmp-checkpoint-<step>/, renamed when complete)
        sharded/                    DCP model (+ optimizer) shards   (SHARDED_STATE_DICT)
        model.safetensors           full model                       (FULL_STATE_DICT)
        optimizer/                  DCP optimizer state              (FULL_STATE_DICT)
        scheduler.json, rng_state_<rank>.pt
        trainer_state.json          Hugging Face's file, as transformers writes it
        shardtrain_state.json       what an exact resume adds: the batch plan and the data position
        tied_weights.json, manifest.json, config.json
        base_model.json             adapter (LoRA) checkpoints: class and hash of the frozen base (not saved)

A run that shards nothing (FSDP off: one plain process) writes Hugging Face's files instead of the DCP optimizer,
`scheduler.json` and `rng_state_<rank>.pt` (`hf_files`: optimizer.pt, scheduler.pt, rng_state.pth), so
`transformers.Trainer` resumes it; a checkpoint written by `transformers.Trainer` (no manifest, none of our files)
resumes here on any layout.
"""

import re
from pathlib import Path

from shardtrain.checkpoint.manifest import MANIFEST_FILE
from shardtrain.errors import CheckpointError

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
SHARDED_DIR = "sharded"
OPTIMIZER_DIR = "optimizer"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
STATE_FILE = "trainer_state.json"
ENGINE_STATE_FILE = "shardtrain_state.json"
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
    if (path / "pytorch_model.bin").is_file():
        raise CheckpointError(f"{path} holds its model as pytorch_model.bin, a pickle, which is never loaded; "
                              "resume from a checkpoint saved with safetensors (transformers' default, "
                              "save_safetensors=True)")
    raise CheckpointError(f"{path} holds no model (no sharded/ and no model.safetensors); pass a checkpoint-<step> "
                          "directory written by shardtrain or by transformers' Trainer")


def is_transformers_checkpoint(path: Path) -> bool:
    """Whether `path` was written by `transformers.Trainer`: its `trainer_state.json` without any file of ours."""
    ours = (MANIFEST_FILE, ENGINE_STATE_FILE, TIED_FILE)
    return (path / STATE_FILE).is_file() and not any((path / name).exists() for name in ours)


def checkpoint_kind_or_none(path: Path) -> str | None:
    """`checkpoint_kind`, or None for a directory that holds no model."""
    try:
        return checkpoint_kind(path)
    except CheckpointError:
        return None


def is_weight_file(name: str) -> bool:
    """Whether `name` (relative to a checkpoint) is one of the full model's safetensors files or their index."""
    return "/" not in name and name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json"))
