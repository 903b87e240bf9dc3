"""Per-rank host and device memory of loading, training and saving, from the traced model's tensor layout.

The step is traced (`trace.py`); loading and saving are not run: their memory follows from each tensor's full
size, rank 0's shard of it (the largest: FSDP2 shards with `torch.chunk`, so the remainder falls on the last
ranks) and the file layout that the save code itself computes (`plan_weight_files`, `staging_groups`,
`owned_files` are called, not copied). What each phase holds, as the code does it:

* load, sharded read (`cpu_ram_efficient_loading`, safetensors covering the model; `parallel/loading.py`):
  the meta model is parallelised, `to_empty` allocates the shard, DCP's `HuggingFaceStorageReader` reads one
  file after the other; `safe_open(...).get_slice(...)[rows]` is a view of the mapped file and `copy_` into the
  shard touches the rank's pages of it, which stay resident until the file is closed. Host peak on rank r:
  max over files f (in read order) of (shard bytes filled so far + rank r's bytes of f). On an accelerator the
  shard is device memory and the host holds the mapped pages of one file.
* load, rank-0 path (other sources): rank 0 holds the whole model (`from_pretrained`, moved to its device) next
  to its shard; every other rank its shard and one whole tensor while it is broadcast.
* load without `cpu_ram_efficient_loading`: every rank `from_pretrained`s the whole model.
* `save_model` (`checkpoint/hf_export.py`): phase 1, DCP serialises each rank's part of one staging file in
  memory twice (2 x the rank's largest staging group); phase 2, the owner of an output file (file i -> rank
  (i - 1) mod N) assembles one full tensor at a time in a `bytearray` from `f.read` of each piece: the new
  tensor's buffer is allocated while the previous tensor and its last piece are still referenced, and each read
  while the previous piece is. Both phases are host memory.
* checkpoints: SHARDED_STATE_DICT writes the shard (DCP, one tensor at a time staged to the host from a
  device); FULL_STATE_DICT writes the model files as `save_model` does (`CheckpointManager` calls the same
  `save_sharded_pretrained`; a LoRA adapter, the XLA backend and non-float states are still gathered to rank 0)
  and then the optimizer's shards like SHARDED_STATE_DICT.
Checked against `benchmarks/results/sharded_load.json` and `benchmarks/results/sharded_save.json`
(`benchmarks/plan_lifecycle.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardtrain.checkpoint.full import DEFAULT_MAX_SHARD_BYTES, plan_weight_files
from shardtrain.checkpoint.hf_export import owned_files, staging_groups


@dataclass(frozen=True)
class TensorLayout:
    """One saved tensor: its bytes whole, rank 0's shard of it, and how many ranks hold distinct pieces."""

    name: str
    full_bytes: int
    local_bytes: int
    pieces: int = 1


@dataclass(frozen=True)
class PhaseMemory:
    """One row of the load / step / save table: peak bytes on rank 0 and on the worst other rank.

    `parts` names the terms of the formula (bytes), for JSON and the checks against measurements;
    `selected` is True for the path the planned fsdp_config takes.
    """

    name: str
    rank0_host: int
    rank0_device: int
    other_host: int
    other_device: int
    note: str = ""
    selected: bool = False
    parts: dict[str, int] = field(default_factory=dict)


def _pieces(tensor: DTensor) -> int:
    """Ranks with a distinct non-empty piece (what DCP writes once each; replicas are de-duplicated).

    Rank 0 holds the largest piece (torch.chunk), so whole / rank 0's piece, rounded up, counts the non-empty
    ones; this also covers the strided 2-D placements of expert weights (ep x efsdp).
    """
    local = tensor.to_local().numel()
    return min(-(-tensor.numel() // local), tensor.device_mesh.size()) if local else 1


def tensor_layout(model: nn.Module) -> list[TensorLayout]:
    """The tensors `save_model` writes (`sharded_state`: tied aliases once), in state-dict order, as laid out."""
    from shardtrain.checkpoint.hf_export import sharded_state

    out = []
    for name, tensor in sharded_state(model).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        full = tensor.numel() * tensor.element_size()
        if isinstance(tensor, DTensor):
            local = tensor.to_local()
            out.append(TensorLayout(name, full, local.numel() * local.element_size(), _pieces(tensor)))
        else:  # replicated: DCP writes it once
            out.append(TensorLayout(name, full, full, 1))
    return out


def load_sharded_read(layout: list[TensorLayout], weight_map: dict[str, str] | None = None) -> dict[str, int]:
    """Rank 0's terms of the sharded read: shard, the most mapped pages of one file, the timeline peak.

    Args:
        layout: `tensor_layout` of the parallelised model.
        weight_map: key -> file of the checkpoint read (default: the files `save_model` writes).
    """
    weight_map = weight_map or plan_weight_files({t.name: t.full_bytes for t in layout}, DEFAULT_MAX_SHARD_BYTES)
    per_file: dict[str, int] = {}  # DCP reads the files in the order their first key comes in the state dict
    for t in layout:
        per_file[weight_map[t.name]] = per_file.get(weight_map[t.name], 0) + t.local_bytes
    filled, peak = 0, 0
    for nbytes in per_file.values():
        filled += nbytes
        peak = max(peak, filled + nbytes)  # the file's pages stay mapped until it is closed
    return {"shard": filled, "mapped_file_pages": max(per_file.values(), default=0), "host_peak_on_host": peak}


def save_model_sharded(layout: list[TensorLayout], world_size: int,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, int]:
    """Host bytes of `save_model`'s two phases beyond the shard: rank 0 and the worst other rank.

    Returns:
        staging (2 x the rank's largest staging group), consolidation on rank 0 / on the other ranks, files.
    """
    sizes = {t.name: t.full_bytes for t in layout}
    weight_map = plan_weight_files(sizes, max_shard_bytes)
    groups = staging_groups(sizes, weight_map, world_size)
    per_group: dict[int, int] = {}
    for t in layout:
        per_group[groups[t.name]] = per_group.get(groups[t.name], 0) + t.local_bytes
    by_name = {t.name: t for t in layout}

    def assemble(files: list[str]) -> int:
        peak = 0
        for file in files:
            prev_full = prev_piece = 0
            for key in (k for k, f in weight_map.items() if f == file):
                t = by_name[key]
                reads = 2 * t.local_bytes if t.pieces > 1 else t.local_bytes
                peak = max(peak, t.full_bytes + max(prev_full + prev_piece, prev_piece + t.local_bytes, reads))
                prev_full, prev_piece = t.full_bytes, t.local_bytes
        return peak

    files = len(set(weight_map.values()))
    others = [assemble(owned_files(weight_map, r, world_size)) for r in range(1, min(world_size, files))]
    return {"staging": 2 * max(per_group.values(), default=0),
            "consolidation_rank0": assemble(owned_files(weight_map, 0, world_size)),
            "consolidation_others": max(others, default=0), "files": files}


def lifecycle_rows(layout: list[TensorLayout], *, world_size: int, target: str, cpu_offload: bool,
                   cpu_ram_efficient_loading: bool, state_dict_type: str, step_device: int, step_host: int,
                   training_state: int, largest_local_state: int) -> list[PhaseMemory]:
    """The load / step / save rows of one plan.

    Args:
        layout: `tensor_layout` of the parallelised model (parameters in their training dtype).
        world_size: ranks; every rank runs the same code, rank 0 holds the largest shard.
        target: "cuda" (parameters on the device unless `cpu_offload`) or "cpu" (one memory: host).
        cpu_offload, cpu_ram_efficient_loading, state_dict_type: the fsdp_config's values (which rows apply).
        step_device, step_host: the traced step's peak on the device and on the host.
        training_state: sharded parameters + optimizer state held between steps (gradients are freed).
        largest_local_state: the largest local tensor of that state (a device tensor staged by DCP).
    """
    on_host = target == "cpu" or cpu_offload
    full = sum(t.full_bytes for t in layout)
    biggest = max((t.full_bytes for t in layout), default=0)
    read = load_sharded_read(layout)
    shard = read["shard"]
    save = save_model_sharded(layout, world_size)
    one = world_size == 1

    def row(name: str, r0: tuple[int, int], other: tuple[int, int], note: str, selected: bool = False,
            **parts: int) -> PhaseMemory:
        """(host, device) for rank 0 and the other ranks; on the CPU target everything is host memory."""
        if target == "cpu":
            r0, other = (r0[0] + r0[1], 0), (other[0] + other[1], 0)
        if one:
            other = (0, 0)
        return PhaseMemory(name, r0[0], r0[1], other[0], other[1], note, selected, parts)

    def where(nbytes: int, host_extra: int = 0) -> tuple[int, int]:
        """`nbytes` where the parameters live, + `host_extra` on the host."""
        return (nbytes + host_extra, 0) if on_host else (host_extra, nbytes)

    sharded_load = (read["host_peak_on_host"], 0) if on_host else (read["mapped_file_pages"], shard)
    staged = largest_local_state if not on_host else 0
    rank0_save = max(save["staging"], save["consolidation_rank0"])
    other_save = max(save["staging"], save["consolidation_others"])
    rows = [
        row("load: sharded read", sharded_load, sharded_load,
            "cpu_ram_efficient_loading + safetensors: shard + mapped pages of one file", cpu_ram_efficient_loading,
            shard=shard, mapped_file_pages=read["mapped_file_pages"]),
        # load_pretrained's rank 0 reads on the host, then moves the whole model to its device
        row("load: rank-0 read + broadcast", (full, shard + full) if not on_host else (full + shard, 0),
            where(shard + biggest), "other sources: rank 0 whole model; others shard + 1 tensor",
            full_model=full, largest_tensor=biggest, shard=shard),
        row("load: every rank reads all", (full, full) if not on_host else (full, 0),
            (full, full) if not on_host else (full, 0), "no cpu_ram_efficient_loading: the whole model per rank",
            not cpu_ram_efficient_loading, full_model=full),
        row("step (predicted peak)", (step_host, step_device), (step_host, step_device),
            "the traced step (rank 0; other ranks hold at most as much)", True),
        row("save_model (sharded export)", where(training_state, rank0_save), where(training_state, other_save),
            "training state + staging piece or one assembled tensor", True, training_state=training_state,
            staging=save["staging"], consolidation_rank0=save["consolidation_rank0"],
            consolidation_others=save["consolidation_others"], files=save["files"]),
        row("checkpoint: SHARDED_STATE_DICT", where(training_state, staged), where(training_state, staged),
            "the shard, one tensor at a time to the files", state_dict_type == "SHARDED_STATE_DICT",
            training_state=training_state, staged_tensor=staged),
        # the model files as save_model writes them (every rank its part), then the optimizer as DCP shards
        row("checkpoint: FULL_STATE_DICT", where(training_state, max(rank0_save, staged)),
            where(training_state, max(other_save, staged)),
            "model files written by every rank, as save_model (+ the optimizer as DCP shards)",
            state_dict_type == "FULL_STATE_DICT", training_state=training_state, staging=save["staging"],
            consolidation_rank0=save["consolidation_rank0"], consolidation_others=save["consolidation_others"],
            staged_tensor=staged),
    ]
    return rows


DEFAULT_RANKS_PER_MACHINE = 8  # a GPU machine's usual count (`shardtrain plan --ranks-per-machine`)


def host_per_machine(rows: list[PhaseMemory], world_size: int, host_memory: int | None,
                     ranks_per_machine: int | None = None) -> dict:
    """The host memory rank 0's machine needs in the phase of this fsdp_config that needs most (rank 0 and its
    machine's other ranks together), against `host_memory` (default: this machine's)."""
    import psutil

    ranks = min(world_size, ranks_per_machine or DEFAULT_RANKS_PER_MACHINE)
    available = host_memory if host_memory is not None else psutil.virtual_memory().total
    chosen = [r for r in rows if r.selected] or rows
    worst = max(chosen, key=lambda r: r.rank0_host + (ranks - 1) * r.other_host)
    peak = worst.rank0_host + (ranks - 1) * worst.other_host
    return {"ranks_per_machine": ranks, "peak_bytes": peak, "phase": worst.name, "host_memory_bytes": available,
            "host_memory_source": "--host-memory" if host_memory is not None else "this machine's",
            "fits": peak <= available}
