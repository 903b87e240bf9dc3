"""Full (unsharded) model checkpoints in the layout `transformers` loads: config.json + safetensors.

Above `max_shard_bytes` the weights are split into `model-0000i-of-0000n.safetensors` with a
`model.safetensors.index.json`, as `save_pretrained` does. Tensors that share storage (tied weights) are
written once; `from_pretrained` re-ties them from the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shardtrain.checkpoint.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def dedupe_tied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later keys whose tensor shares storage with an earlier key (safetensors refuses shared tensors)."""
    seen: dict[tuple, str] = {}
    out = {}
    for key, tensor in state_dict.items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and ident in seen:
            continue
        seen[ident] = key
        out[key] = tensor
    return out


def write_full_checkpoint(state_dict: dict[str, torch.Tensor], out_dir: str | Path, config: dict[str, Any] | None,
                          max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write `state_dict` as safetensors (split above `max_shard_bytes`) and `config.json`; returns file names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in dedupe_tied(state_dict).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    files = []
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out / SINGLE_FILE, metadata=metadata)
        files.append(SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / name, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
            files.append(name)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
        files.append(INDEX_FILE)
    for name in files:
        os.chmod(out / name, 0o644)  # safetensors writes 0600; checkpoints are shared artefacts
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        files.append("config.json")
    return files


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a full checkpoint (single file or the index's shards)."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():
        index = json.loads((directory / INDEX_FILE).read_text())
        return [directory / name for name in sorted(set(index["weight_map"].values()))]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise CheckpointError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}; it is not a full checkpoint")


def read_full_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor in a full checkpoint, without reading the data."""
    shapes = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} is corrupt or truncated ({err}); load an earlier checkpoint") from err
    return shapes


def read_full_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Load every tensor of a full checkpoint (safetensors only: no pickle)."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    state[key] = handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} is corrupt or truncated ({err}); load an earlier checkpoint") from err
    return state
