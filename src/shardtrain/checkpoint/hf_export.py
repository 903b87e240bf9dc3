"""`Trainer.save_model`'s full model in Hugging Face's layout, written by every rank and held whole by none.

The gather path (`full_model_state` + `write_full_checkpoint`) materialises the whole state dict on rank 0,
which does not fit for big models (an 8B model in fp32 is 32 GB on one host; accelerate issue #3633). Here:

1. every rank writes the local shards of its DTensors with `dcp.save` and torch's `HuggingFaceStorageWriter`
   (`save_distributed=True`) into a staging directory inside the output directory, in staging files of at most
   256 MiB of the model (`staging_groups`): beyond its shard a rank holds the serialised bytes of its part of one
   staging file;
2. every rank consolidates the output files assigned to it (file i -> rank (i - 1) % world_size) with torch's
   safetensors consolidation, which reads the shards' byte ranges from disk and assembles one tensor at a time:
   a rank holds at most one full tensor (plus one shard of it) beyond its own shard;
3. rank 0 moves the finished files into the output directory, the index last, and removes the staging directory.

Why not torch's own `enable_consolidation=True`: it runs in `finish()` on the coordinator alone (rank 0 writes
every file, one after the other), and `consolidate_safetensors_files_on_every_rank` ends with collectives that
a rank whose write failed never reaches (its peers would hang); calling the per-file consolidation directly on
every rank keeps the memory bound, spreads the writes and lets failures be agreed on like every other save.

The file split (`plan_weight_files`: one `model.safetensors` up to 5 GiB, then `model-0000i-of-0000n`) is the
one `write_full_checkpoint` and `shardtrain merge` use, so every path writes the same files and keys.
Every rank must see the output directory (a shared filesystem on several hosts), as for sharded checkpoints.
The tensors are those of the gather path bit for bit; the files' headers differ (torch's consolidation writes
no `{"format": "pt"}` metadata, which `from_pretrained` does not need). `_consolidate_safetensors_files` is
torch-private (present in the torch the tests pin, 2.13): where this torch lacks it or the HF storage writer,
`unsupported` says so and `save_model` gathers on rank 0 as before.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

try:  # torch >= 2.8 (pyproject allows 2.6): without them, save_model keeps the rank-0 path
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files
except ImportError:  # pragma: no cover - the tests' torch has both
    HuggingFaceStorageReader = HuggingFaceStorageWriter = _consolidate_safetensors_files = None
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardtrain.checkpoint.full import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    index_json,
    plan_weight_files,
    tensor_nbytes,
    write_config,
)
from shardtrain.parallel import collectives
from shardtrain.parallel.pipeline_split import published_aliases
from shardtrain.parallel.states import tied_aliases

STAGING_DIR = ".shardtrain-save"  # inside the output directory: same filesystem, so the final moves are renames
STAGING_BYTES = 256 * 1024**2  # global bytes per staging file (see `staging_groups`)
STAGING_FILES = 512  # staging files of all ranks together, at most (about): the consolidation opens them all


def sharded_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as DTensors (each rank's shard, no communication), tied aliases dropped.

    Keys are those of `full_model_state` (same `get_model_state_dict` naming), i.e. what `save_pretrained` writes.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    for published, own in published_aliases(model).items():  # a pipeline's last stage: its tied head
        state[published] = state.pop(own)
    for alias in tied_aliases(model):
        state.pop(alias, None)
    return state


def unsupported(state: dict[str, torch.Tensor]) -> str | None:
    """Why torch's consolidation cannot write `state` (None: it can), so the caller falls back to gathering.

    The consolidation sizes elements with `torch.finfo` (floating point only) and writes nothing for 0-d
    tensors; trained weights are floating point with a shape, integer buffers are rare and small.
    """
    if HuggingFaceStorageWriter is None or _consolidate_safetensors_files is None:
        return f"torch {torch.__version__} has no HuggingFaceStorageWriter / safetensors consolidation"
    for key, tensor in state.items():
        if not tensor.is_floating_point() or tensor.dim() == 0:
            return f"{key} is {tensor.dtype} with shape {tuple(tensor.shape)}"
    return None


def distributed_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """`sharded_state(model)` when every rank can write and read its full-model files itself: the model is
    sharded (DTensors) and torch's consolidation takes every tensor (`unsupported`); None: gather on rank 0."""
    state = sharded_state(model)
    if not any(isinstance(tensor, DTensor) for tensor in state.values()) or unsupported(state) is not None:
        return None
    return state


def read_sharded_pretrained(state: dict[str, torch.Tensor], path: Path) -> None:
    """Fill `state` (`sharded_state`'s DTensor shards) from the safetensors files in `path`, each rank reading
    only the slices of its shards (`safe_open(...).get_slice`: nothing is unpickled); collective."""
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))


def owned_files(weight_map: dict[str, str], rank: int, world_size: int) -> list[str]:
    """The output files `rank` consolidates: the i-th file name (sorted) goes to rank (i - 1) % world_size."""
    names = sorted(set(weight_map.values()))
    return [name for i, name in enumerate(names) if i % world_size == rank]


def staging_groups(sizes: dict[str, int], weight_map: dict[str, str], world_size: int) -> dict[str, int]:
    """Key -> index (1-based) of the staging file DCP writes it into on each rank.

    DCP serialises each rank's part of one file in memory (twice: safetensors' `save` builds the bytes), so
    staging files of at most `STAGING_BYTES` (or one tensor) bound that buffer to ~2 x STAGING_BYTES / world_size
    instead of 2 x the rank's share of a whole output file. The consolidation opens every staging file of every
    rank at once, so above `STAGING_FILES` files in all the groups grow instead.
    """
    budget = max(STAGING_BYTES, -(-sum(sizes.values()) * world_size // STAGING_FILES))
    groups: dict[str, int] = {}
    index, size, file = 0, 0, None
    for key, nbytes in sizes.items():
        if index == 0 or weight_map[key] != file or size + nbytes > budget:
            index, size, file = index + 1, 0, weight_map[key]
        groups[key] = index
        size += nbytes
    return groups


def save_sharded_pretrained(model: nn.Module, out: Path, config: dict[str, Any] | None, *, rank: int,
                            world_size: int, agree: Callable[[str | None], None],
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                            state: dict[str, torch.Tensor] | None = None,
                            process_group: dist.ProcessGroup | None = None) -> list[str]:
    """Write `model`'s weights (+ config.json) into `out` as `save_pretrained` lays them out; collective.

    Args:
        model: the FSDP2 (DTensor) model; a replicated plain tensor is written by one rank (DCP's de-duplication).
        out: the output directory (created by rank 0 if needed).
        config: `config.json`'s contents, written by rank 0 (None: none).
        rank: this process's rank in the default process group.
        world_size: the default process group's size.
        agree: collective: raises the same error on every rank if any rank passed a problem (else returns).
        max_shard_bytes: above this the weights are split into several files (`plan_weight_files`).
        state: `sharded_state(model)` when the caller already has it (or a staged copy of it: an async save).
        process_group: the group of DCP's collectives (None: the default group; an async save passes its own,
            so that the background write never meets the training's collectives).

    Returns:
        The names of the files written into `out`.
    """
    state = sharded_state(model) if state is None else state
    sizes: dict[str, int] = {}  # every rank's keys (a pipeline's stages hold different ones), in rank order
    for part in collectives.gather_objects({key: tensor_nbytes(tensor) for key, tensor in state.items()},
                                           group=process_group):
        sizes.update(part)
    weight_map = plan_weight_files(sizes, max_shard_bytes)
    names = sorted(set(weight_map.values()))
    # the consolidation names output file i "model-0000i-of-0000n"; a single one is published as model.safetensors
    index_of = {name: i for i, name in enumerate(names, start=1)}
    staging = out / STAGING_DIR

    def prepare() -> None:
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that failed part-way
        staging.mkdir(parents=True)

    _run(prepare if rank == 0 else None, agree, staging, rank, f"create {STAGING_DIR}")
    groups = staging_groups(sizes, weight_map, world_size)

    def write_shards() -> None:  # the writer makes its directory on every rank: inside the agreed phase
        writer = HuggingFaceStorageWriter(str(staging / "sharded"), save_distributed=True,
                                          fqn_to_index_mapping=groups)
        dcp.save(state, storage_writer=writer, process_group=process_group)

    _run(write_shards, agree, staging, rank, "write the shards")
    mine = set(owned_files(weight_map, rank, world_size))
    mapping = {key: _dcp_name(index_of[name], len(names)) for key, name in weight_map.items() if name in mine}
    _run((lambda: _consolidate_safetensors_files(input_dir=str(staging / "sharded"), output_dir=str(staging),
                                                 fqn_to_file_mapping=mapping, num_threads=1)) if mapping else None,
         agree, staging, rank, "consolidate the safetensors files")
    files: list[str] = []
    _run((lambda: files.extend(_publish(staging, out, weight_map, config, index_of, sum(sizes.values()))))
         if rank == 0 else None, agree, staging, rank, "move the files into place")
    return files


def _dcp_name(index: int, count: int) -> str:
    """torch's name for consolidated output file `index` (1-based) of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _run(work: Callable[[], Any] | None, agree: Callable[[str | None], None], staging: Path, rank: int,
         what: str) -> None:
    """Run one phase (None: nothing on this rank), then agree that it worked everywhere; on failure rank 0
    removes the staging directory (what `out` held before is untouched) and every rank raises `agree`'s error.

    A failing rank must not leave its peers waiting in the next collective, hence one agreement per phase.
    """
    problem = None
    try:
        if work is not None:
            work()
    except (Exception, CheckpointException) as err:  # noqa: B014 - DCP's error is not always an Exception
        problem = (f"could not write the model to {staging.parent} ({what}): {err}; free space or choose another "
                   "directory")
    try:
        agree(problem)
    except Exception:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, out: Path, weight_map: dict[str, str], config: dict[str, Any] | None,
             index_of: dict[str, int], total_size: int) -> list[str]:
    """Rank 0: move the consolidated files from `staging` into `out`, then the index and config.

    Each file appears complete or not at all (os.replace within one filesystem). Weight files of an earlier
    save that this one does not replace are removed first, the index first, so `out` never pairs an old index
    with new files; the new index moves in last, so a directory with an index has all of its files.
    """
    for stale in [out / INDEX_FILE, out / SINGLE_FILE, *sorted(out.glob("model-*-of-*.safetensors"))]:
        if stale.name not in index_of:
            stale.unlink(missing_ok=True)
    files = []
    for name, index in index_of.items():
        source = staging / _dcp_name(index, len(index_of))
        os.chmod(source, 0o644)  # as write_full_checkpoint: checkpoints are shared artefacts
        os.replace(source, out / name)
        files.append(name)
    if len(index_of) > 1:
        (staging / INDEX_FILE).write_text(index_json(weight_map, total_size))
        os.replace(staging / INDEX_FILE, out / INDEX_FILE)
        files.append(INDEX_FILE)
    if config is not None:
        write_config(out, config)
        files.append("config.json")
    shutil.rmtree(staging, ignore_errors=True)
    return files
