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

from shardtrain.errors import CheckpointError

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


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole tensor (a DTensor's global shape, not its local shard)."""
    return tensor.numel() * tensor.element_size()


def plan_weight_files(sizes: dict[str, int], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, str]:
    """Key -> file name for tensors of `sizes` (bytes, in state-dict order): one `model.safetensors` up to
    `max_shard_bytes`, else `model-0000i-of-0000n.safetensors` filled in order as `save_pretrained` splits.

    `write_full_checkpoint` (merge, checkpoints) and the sharded `save_model` path both use it, so the same
    weights land in the same files whichever path wrote them.
    """
    groups: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    if len(groups) == 1:
        return dict.fromkeys(groups[0], SINGLE_FILE)
    names = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    return {key: name for name, group in zip(names, groups) for key in group}


def index_json(weight_map: dict[str, str], total_size: int) -> str:
    """The text of `model.safetensors.index.json` (what `from_pretrained` reads for split weights)."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2)


def write_config(out: Path, config: dict[str, Any]) -> None:
    """`config.json` as every full-checkpoint writer here writes it."""
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def write_full_checkpoint(state_dict: dict[str, torch.Tensor], out_dir: str | Path, config: dict[str, Any] | None,
                          max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write `state_dict` as safetensors (split above `max_shard_bytes`) and `config.json`; returns file names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in dedupe_tied(state_dict).items()}
    weight_map = plan_weight_files({k: tensor_nbytes(v) for k, v in tensors.items()}, max_shard_bytes)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        shards.setdefault(weight_map[key], {})[key] = tensor
    metadata = {"format": "pt"}
    files = []
    for name, shard in shards.items():
        save_file(shard, out / name, metadata=metadata)
        files.append(name)
    if len(shards) > 1:
        total = sum(tensor_nbytes(t) for t in tensors.values())
        (out / INDEX_FILE).write_text(index_json(weight_map, total))
        files.append(INDEX_FILE)
    for name in files:
        os.chmod(out / name, 0o644)  # safetensors writes 0600; checkpoints are shared artefacts
    if config is not None:
        write_config(out, config)
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


def weights_problem(directory: str | Path) -> str | None:
    """What keeps the full model's files in `directory` from being read (a missing shard, a damaged header), or
    None."""
    try:
        read_full_shapes(directory)
    except CheckpointError as err:
        return str(err)
    return None
