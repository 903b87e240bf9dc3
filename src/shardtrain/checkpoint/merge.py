"""`shardtrain merge CHECKPOINT_DIR OUTPUT_DIR`: a sharded checkpoint -> the full safetensors layout.

    shardtrain merge out/checkpoint-500 out/model
    shardtrain merge out/checkpoint-500 out/merged --merge-lora --base path/to/base   # LoRA: adapters folded in

Offline and single-process: no process group, no GPU. Reads DCP's metadata to size every tensor, loads the
shards with `torch.distributed.checkpoint.load(no_dist=True)`, and writes what `Trainer.save_model` writes.
A LoRA checkpoint holds the adapters only: `--merge-lora --base DIR` loads the base model from DIR (refused
unless its frozen weights hash to the checkpoint's `base_model.json`), adds the adapters of the checkpoint's
`adapter_config.json`, and writes the model with them merged (peft's `merge_and_unload`).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardtrain.checkpoint.full import DEFAULT_MAX_SHARD_BYTES, read_full_checkpoint, write_full_checkpoint
from shardtrain.checkpoint.layout import BASE_FILE, SHARDED_DIR, checkpoint_kind
from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata
from shardtrain.errors import CheckpointError


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
        with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": we are
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({"model": model}, path, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"could not read {path}: {err}; the shard files are corrupt or truncated") from err
    return model


def merge_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path, *,
                     lora_base: str | Path | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `checkpoint_dir`'s model as config.json + safetensors into `output_dir` (created if needed).

    The files are those `Trainer.save_model` writes for the same weights and `max_shard_bytes` (both split with
    `plan_weight_files`): `model.safetensors`, or `model-0000i-of-0000n.safetensors` + the index.

    Args:
        lora_base: for a LoRA checkpoint (adapters only), the directory of its base model; the output is the base
            with the adapters merged in.
        max_shard_bytes: above this the weights are split into several files.

    Raises:
        FileNotFoundError: `checkpoint_dir` does not exist.
        CheckpointError: not a shardtrain checkpoint, or damaged; `output_dir` is non-empty; a LoRA checkpoint
            without `lora_base`, or a base that is not the one the adapters were trained on.
    """
    source, out = Path(checkpoint_dir), Path(output_dir)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint directory {source} does not exist")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output path {out} is a file, not a directory; choose a new directory (nothing was "
                              f"written)")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"output directory {out} is not empty; choose a new directory (nothing was written)")
    problem = _uncreatable(out)
    if problem is not None:
        raise CheckpointError(f"output directory {out} cannot be created: {problem}; choose another directory "
                              "(nothing was written)")
    kind = checkpoint_kind(source)
    problem = CheckpointManager.problem(source)  # as resume checks it: the manifest's sizes and checksums
    if problem is not None:
        raise CheckpointError(f"cannot merge {source}: {problem}; merge an intact checkpoint (nothing was written)")
    has_adapters = (source / BASE_FILE).is_file()
    if has_adapters != (lora_base is not None):
        raise CheckpointError(
            f"{source} holds LoRA adapters only; pass --merge-lora --base DIR (the base model they were trained on)"
            if has_adapters else f"{source} holds a whole model, not LoRA adapters; drop --merge-lora / --base")
    state = load_sharded_model(source) if kind == "SHARDED_STATE_DICT" else read_full_checkpoint(source)
    if has_adapters:
        return _merge_adapters(source, state, Path(lora_base), out, max_shard_bytes)
    config_file = source / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else None
    aliases_file = source / "tied_weights.json"
    if aliases_file.is_file():  # DCP stores a tied weight under each name; save_model writes it once
        for alias in json.loads(aliases_file.read_text()):
            state.pop(alias, None)
    write_full_checkpoint(state, out, config, max_shard_bytes)
    return out



def _uncreatable(out: Path) -> str | None:
    """Why `out` could not be made a directory, found without creating anything: an ancestor that is a file, or
    the nearest existing one not writable; None when it can be."""
    parent = out
    while not parent.exists():
        if parent.parent == parent:
            return None
        parent = parent.parent
    if parent != out and not parent.is_dir():
        return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def _merge_adapters(source: Path, adapters: dict[str, torch.Tensor], base_dir: Path, out: Path,
                    max_shard_bytes: int) -> Path:
    """Base from `base_dir` + the checkpoint's adapters -> merged model in `out`."""
    from peft import PeftConfig, get_peft_model

    from shardtrain.checkpoint.model_state import base_problem, frozen_identity, model_config_dict
    from shardtrain.model_facts import model_class_from_config

    if not (base_dir / "config.json").is_file():
        raise CheckpointError(f"--base {base_dir} has no config.json; pass the base model's directory")
    base = model_class_from_config(base_dir).from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(base, PeftConfig.from_pretrained(str(source)))
    problem = base_problem(source, frozen_identity(model))
    if problem is not None:
        raise CheckpointError(f"cannot merge: {problem}")
    _, unexpected = model.load_state_dict(adapters, strict=False)
    absent = [name for name, param in model.named_parameters() if param.requires_grad and name not in adapters]
    if unexpected or absent:
        raise CheckpointError(f"{source} does not fit the adapted base: unexpected {unexpected[:3]}, missing "
                              f"{absent[:3]}; was it written with this adapter_config.json?")
    merged = model.merge_and_unload()
    write_full_checkpoint(merged.state_dict(), out, model_config_dict(merged), max_shard_bytes)
    return out
