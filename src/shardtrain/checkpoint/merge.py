"""`shardtrain merge CHECKPOINT_DIR OUTPUT_DIR`: a sharded checkpoint -> the full safetensors layout.

Offline and single-process: no process group, no GPU. Reads DCP's metadata to size every tensor, loads the
shards with `torch.distributed.checkpoint.load(no_dist=True)`, and writes what `Trainer.save_model` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardtrain.checkpoint.errors import CheckpointError
from shardtrain.checkpoint.full import read_full_checkpoint, write_full_checkpoint
from shardtrain.checkpoint.layout import SHARDED_DIR
from shardtrain.checkpoint.manager import checkpoint_kind
from shardtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata


def load_sharded_model(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict stored in a SHARDED_STATE_DICT checkpoint."""
    path = Path(checkpoint_dir) / SHARDED_DIR
    try:
        metadata = read_dcp_metadata(path)
    except CheckpointError:  # refused by the restricted unpickler: keep its message
        raise
    except Exception as err:
        raise CheckpointError(f"{path} has no readable DCP metadata ({err}); is it a shardtrain sharded "
                              "checkpoint?") from err
    model: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise CheckpointError(f"{path} holds no model tensors")
    try:
        dcp_load({"model": model}, path, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"could not read {path}: {err}; the shard files are corrupt or truncated") from err
    return model


def merge_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path) -> Path:
    """Write `checkpoint_dir`'s model as config.json + safetensors into `output_dir` (created if needed).

    Raises:
        FileNotFoundError: `checkpoint_dir` does not exist.
        CheckpointError: not a shardtrain checkpoint, or damaged; `output_dir` is non-empty.
    """
    source, out = Path(checkpoint_dir), Path(output_dir)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint directory {source} does not exist")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"output directory {out} is not empty; choose a new directory (nothing was written)")
    kind = checkpoint_kind(source)
    state = load_sharded_model(source) if kind == "SHARDED_STATE_DICT" else read_full_checkpoint(source)
    config_file = source / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else None
    aliases_file = source / "tied_weights.json"
    if aliases_file.is_file():  # DCP stores a tied weight under each name; save_model writes it once
        for alias in json.loads(aliases_file.read_text()):
            state.pop(alias, None)
    write_full_checkpoint(state, out, config)
    return out

