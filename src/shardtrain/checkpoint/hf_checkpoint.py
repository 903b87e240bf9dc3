"""`shardtrain merge --hf-checkpoint CKPT OUT`: a checkpoint of an FSDP run (any ranks, sharded or full) -> the
`checkpoint-<step>` that transformers' one-process Trainer resumes with its optimizer, scheduler and RNG.

    shardtrain merge --hf-checkpoint out/checkpoint-500 hf_out/checkpoint-500
    transformers.Trainer(..., args=TrainingArguments("hf_out")).train(resume_from_checkpoint="hf_out/checkpoint-500")

Offline, one process, no process group. Writes what transformers' `_save_checkpoint` writes:
- the model (config.json + safetensors, as `shardtrain merge`) and the files beside it (generation config,
  tokenizer), trainer_state.json as it is;
- optimizer.pt: the DCP optimizer state (keyed by parameter name) with each parameter numbered by its place in
  the parameter groups, which are Hugging Face's (weight decay, then none) in the model's order on both sides;
- scheduler.pt (the scheduler's state dict), rng_state.pth (rank 0's generators, in Hugging Face's format).
Nothing is unpickled but through `torch.load(weights_only=True)` (`safe_load`).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardtrain.checkpoint import hf_files
from shardtrain.checkpoint.layout import (
    BASE_FILE,
    ENGINE_STATE_FILE,
    OPTIMIZER_DIR,
    RNG_PREFIX,
    SCHEDULER_FILE,
    SHARDED_DIR,
    STATE_FILE,
    TIED_FILE,
    checkpoint_kind,
)
from shardtrain.checkpoint.manifest import MANIFEST_FILE
from shardtrain.checkpoint.merge import merge_checkpoint
from shardtrain.checkpoint.model_state import set_rng_state
from shardtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata
from shardtrain.errors import CheckpointError

# our files, which transformers neither writes nor reads (everything else beside the model is copied)
OWN_FILES = (MANIFEST_FILE, ENGINE_STATE_FILE, TIED_FILE, SCHEDULER_FILE, BASE_FILE, "config.json")


def export_hf_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path) -> Path:
    """Write `checkpoint_dir` (a shardtrain checkpoint of an FSDP run) as transformers' checkpoint layout.

    Raises:
        FileNotFoundError: `checkpoint_dir` does not exist.
        CheckpointError: not a checkpoint of an FSDP run (a one-process run already writes this layout), a LoRA
            checkpoint, damaged, or `output_dir` not empty (nothing is written then).
    """
    source, out = Path(checkpoint_dir), Path(output_dir)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint directory {source} does not exist")
    if (source / hf_files.OPTIMIZER_FILE).is_file():
        raise CheckpointError(f"{source} is already in transformers' layout (optimizer.pt): a one-process run "
                              "writes it; resume it with transformers as it is")
    if (source / BASE_FILE).is_file():
        raise CheckpointError(f"{source} holds LoRA adapters: transformers resumes adapter training through peft's "
                              "own files, which this export does not write; merge the adapters with --merge-lora "
                              "--base DIR, or resume with shardtrain")
    if not (source / STATE_FILE).is_file():  # checked before anything is written
        raise CheckpointError(f"{source} has no {STATE_FILE}; transformers cannot resume without it")
    optimizer_dir = source / (SHARDED_DIR if checkpoint_kind(source) == "SHARDED_STATE_DICT" else OPTIMIZER_DIR)
    merge_checkpoint(source, out)  # checks the manifest and that `out` is empty or creatable
    try:
        optimizer = optimizer_by_position(optimizer_dir) if optimizer_dir.is_dir() else None
        if optimizer is not None:
            torch.save(optimizer, out / hf_files.OPTIMIZER_FILE)
        if (source / SCHEDULER_FILE).is_file():
            torch.save(json.loads((source / SCHEDULER_FILE).read_text()), out / hf_files.SCHEDULER_FILE)
        if (source / f"{RNG_PREFIX}0.pt").is_file():
            _write_hf_rng(hf_files.load_tensors(source / f"{RNG_PREFIX}0.pt"), out)
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name not in OWN_FILES and not path.name.startswith(RNG_PREFIX):
                shutil.copy2(path, out / path.name)  # trainer_state.json, generation config, tokenizer files
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # merge made it: no half-written checkpoint is left
        raise
    return out


def optimizer_by_position(path: Path) -> dict[str, Any]:
    """The optimizer state of the DCP directory `path` as `torch.optim.Optimizer.state_dict()` lays it out:
    parameters numbered in param-group order (what transformers' `optimizer.load_state_dict` maps by position)."""
    metadata = read_dcp_metadata(path)
    entries: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("optimizer."):
            entries[key] = torch.empty(meta.size, dtype=meta.properties.dtype) \
                if isinstance(meta, TensorStorageMetadata) else None
    if not entries:
        raise CheckpointError(f"{path} holds no optimizer state (saved with save_only_model?); nothing to resume")
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": we are
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(entries, path, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"could not read the optimizer state in {path}: {err}; the files are corrupt") from err
    groups: dict[int, dict[str, Any]] = {}
    for key, value in entries.items():
        if key.startswith("optimizer.param_groups."):
            index, _, field = key[len("optimizer.param_groups."):].partition(".")
            groups.setdefault(int(index), {})[field] = value
    position: dict[str, int] = {}
    param_groups = []
    for index in sorted(groups):
        group = dict(groups[index])
        names = group["params"]
        group["params"] = [position.setdefault(name, len(position)) for name in names]
        param_groups.append(group)
    state: dict[int, dict[str, Any]] = {}
    for key, value in entries.items():
        if key.startswith("optimizer.state."):
            name, _, field = key[len("optimizer.state."):].rpartition(".")
            if name not in position:
                raise CheckpointError(f"{path}: optimizer state for {name!r}, which no parameter group lists")
            state.setdefault(position[name], {})[field] = value
    return {"state": state, "param_groups": param_groups}


def _write_hf_rng(saved: dict[str, Any], out: Path) -> None:
    """Rank 0's generators (our tensor format) as Hugging Face's rng_state.pth; this process's are kept."""
    before = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        set_rng_state(saved)
        hf_files.save_rng(out, 0, 1)
    finally:
        random.setstate(before[0])
        np.random.set_state(before[1])
        torch.random.set_rng_state(before[2])
