"""Load a pretrained Hugging Face directory into a sharded model.

With `cpu_ram_efficient_loading`, no rank reads more than it keeps when the directory holds safetensors
whose keys, by transformers' own conversion rules for the model class, cover the model's state dict: every rank
builds the model on the meta device, the parallel layout (tp, ep, FSDP) shards it, and each rank reads only the
rows of its own shards, in the file's dtype. Keys that match the model (or that transformers only renames) go
through DCP's `HuggingFaceStorageReader` (`safe_open(...).get_slice`); tensors transformers fuses from several
keys, such as the per-expert weights of mixture-of-experts checkpoints, are read by `hf_conversion.read_fused`:
only the source slices of this rank's shard (under ep, its experts), assembled by transformers' own converter.
Non-persistent buffers (rotary `inv_freq`, BERT's `position_ids`) are then initialised by the model's own
`initialize_weights` with the loaded parameters marked done, which is how `from_pretrained` itself fills them
after building on meta.

A model object built on the meta device by every rank (`from_pretrained(PATH, device_map="meta",
use_kernels=False)`, which reads nothing; TRL's by-path loading under `cpu_ram_efficient_loading`) is read the same
way from the directory it names (`meta_source`): the backend parallelises it and each rank reads its slices.

Other sources (pickled `.bin` weights, conversions other than stacking and concatenation) keep the rank-0
path: only rank 0 reads the weights, the other ranks build on meta, and the weights arrive by broadcast. Tied
weights stay one parameter on both paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.model_facts import model_class_from_config
from shardtrain.parallel import collectives
from shardtrain.parallel.fsdp import apply_fsdp
from shardtrain.parallel.hf_conversion import ReadPlan, ReadStats, plan_read, read_fused, safetensors_index
from shardtrain.parallel.pipeline_split import stage_split
from shardtrain.parallel.states import TorchStates

try:  # torch >= 2.8 (pyproject allows 2.6): without it, cpu_ram_efficient_loading keeps the rank-0 path
    from torch.distributed.checkpoint import HuggingFaceStorageReader
except ImportError:  # pragma: no cover - the tests' torch has it
    HuggingFaceStorageReader = None

logger = logging.getLogger(__name__)

# How `cpu_ram_efficient_loading` reads a safetensors directory: "sharded" (default: each rank its slices) or
# "rank0" (rank 0 reads everything and broadcasts; the path for other sources, kept selectable to compare).
SHARDED_READ, RANK0_READ = "sharded", "rank0"


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (built without weights)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _meta_model(cls: type, hf_config: Any) -> nn.Module:
    with torch.device("meta"):
        return cls._from_config(hf_config, dtype=torch.float32)


def read_shards(model: nn.Module, path: Path, plan: ReadPlan, device: torch.device) -> ReadStats:
    """Fill the (meta, parallelised) `model` from the safetensors in `path`: each rank its own slices."""
    model.to_empty(device=device)
    state = model.state_dict()
    # state_dict() holds detached views of the sharded parameters: DCP copies into their local shards in place,
    # found under the files' names (a key transformers renames is read into the tensor it names)
    dcp.load({file_key: state[key] for file_key, key in plan.dense.items()},
             storage_reader=HuggingFaceStorageReader(str(path)))
    stats = read_fused(model, path, plan)
    if callable(getattr(model, "initialize_weights", None)):
        # transformers' own way to fill what no file holds (non-persistent buffers) after building on meta: its
        # init functions skip tensors flagged as initialised (tied aliases are the same parameter)
        keys = {*plan.dense.values(), *plan.fused}
        loaded = [*model.parameters(), *(b for name, b in model.named_buffers() if name in keys)]
        for tensor in loaded:
            tensor._is_hf_initialized = True
        # a module that from_pretrained (device_map="meta") marked as done would be skipped whole, buffers included
        done = [module for module in model.modules() if getattr(module, "_is_hf_initialized", False)]
        for module in done:
            module._is_hf_initialized = False
        model.initialize_weights()
        for tensor in loaded:
            del tensor._is_hf_initialized
        for module in done:
            module._is_hf_initialized = True
    return stats


def meta_source(model: nn.Module) -> tuple[Path, ReadPlan] | str:
    """Where a model built on the meta device reads its weights, each rank only its shards: the local directory
    it names (`from_pretrained(PATH, device_map="meta")` keeps PATH as `name_or_path`, reading nothing) and
    transformers' read plan for its safetensors; otherwise a sentence saying why not.

    Args:
        model: on the meta device, before any sharding (global shapes).
    """
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return "it names no directory (name_or_path is empty)"
    path = Path(name)
    if not (path / "config.json").is_file():
        return f"its name_or_path {str(name)!r} is not a local model directory (download it and pass the directory)"
    if HuggingFaceStorageReader is None:
        return f"torch {torch.__version__} has no HuggingFaceStorageReader"
    index = safetensors_index(path)
    if not index:
        return f"{path} has no *.safetensors files"
    plan, why = plan_read(model, index)
    return (path, plan) if plan is not None else f"{path}: {why}"


def read_from_source(model: nn.Module, path: Path, plan: ReadPlan, device: torch.device) -> None:
    """`read_shards` for a model object built on the meta device by every rank (`meta_source`'s directory)."""
    read_shards(model, path, plan, device)
    logger.info("%s: each rank read its shards of %d tensors into the meta-device model that names it", path,
                len(plan.dense) + len(plan.fused))


def load_pretrained(path: str | Path, fsdp_config: FSDPConfig | None, *, model_class: type | None = None,
                    mixed_precision: str | None = None, device: torch.device | None = None,
                    mesh: DeviceMesh | None = None, compile_options: dict | None = None,
                    read: str = SHARDED_READ, parallelize: Callable[[nn.Module], Any] | None = None) -> nn.Module:
    """Load `path` (config.json + weights) and shard it with FSDP2 (`fsdp_config` None: no sharding).

    Args:
        path: a directory written by `save_pretrained`, `Trainer.save_model` or `shardtrain merge`.
        fsdp_config: FSDP settings; `cpu_ram_efficient_loading` selects rank-0-only reading.
        model_class: the class to instantiate; default from `config.json`'s `architectures`.
        mixed_precision: passed on to `apply_fsdp`.
        device: where parameters live (default CPU).
        mesh: the mesh to shard over (default: `apply_fsdp`'s, from the config).
        compile_options: passed on to `apply_fsdp` (torch.compile per FSDP unit).
        read: with `cpu_ram_efficient_loading`, `SHARDED_READ` (each rank reads its slices of safetensors
            files that cover the model; otherwise the rank-0 path) or `RANK0_READ` (always the rank-0 path).
        parallelize: applies the parallel layout in place (default: `apply_fsdp` over `mesh`); the Trainer
            passes its tp -> ep -> FSDP pipeline. It runs on the meta-device model when ranks read shards.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a directory saved by save_pretrained/save_model")
    cls = model_class or model_class_from_config(path)
    device = device or torch.device("cpu")
    config = fsdp_config
    if parallelize is None:
        def parallelize(model: nn.Module) -> None:
            apply_fsdp(model, config, mesh, mixed_precision=mixed_precision, compile_options=compile_options)
    if config is None or not config.cpu_ram_efficient_loading:
        model = cls.from_pretrained(str(path), dtype=torch.float32).to(device)
        if config is None:
            if compile_options is not None:
                model.compile(**compile_options)
            return model
        parallelize(model)
        return model

    if read not in (SHARDED_READ, RANK0_READ):
        raise ValueError(f"load_pretrained: read={read!r}; use {SHARDED_READ!r} or {RANK0_READ!r}")
    hf_config = transformers.AutoConfig.from_pretrained(str(path))
    if hasattr(cls, "_model_mapping"):  # an Auto class (no `architectures` in config.json): the class it picks
        cls = cls._model_mapping[type(hf_config)]
    index = safetensors_index(path) if read == SHARDED_READ and HuggingFaceStorageReader is not None else None
    if index:
        model = _meta_model(cls, hf_config)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        plan, why = plan_read(model, index)
        if plan is not None:
            parallelize(model)
            stats = read_shards(model, path, plan, device)
            fused_sources = sum(len(keys) for target in plan.fused.values() for keys in target.sources.values())
            fused = (f"; {len(plan.fused)} fused from {fused_sources} checkpoint tensors, of which rank "
                     f"{dist.get_rank()} read {len(stats.keys)} ({stats.bytes} bytes)" if plan.fused else "")
            # `read_stats` on the record: what this rank read of the fused tensors' sources (tests count it)
            logger.info("%s: each rank read its shards of %d tensors%s", path, len(plan.dense) + len(plan.fused),
                        fused, extra={"read_stats": {"keys": stats.keys, "bytes": stats.bytes,
                                                     "fused": len(plan.fused), "fused_sources": fused_sources}})
            return model
    elif read == RANK0_READ:
        why = f"read={read!r}"
    elif HuggingFaceStorageReader is None:
        why = f"torch {torch.__version__} has no HuggingFaceStorageReader"
    else:
        why = "no *.safetensors files"
    logger.info("%s: reading on rank 0 and broadcasting (%s)", path, why)
    rank = dist.get_rank()
    if rank == 0:
        model = cls.from_pretrained(str(path), dtype=torch.float32).to(device)
        full_state = model.state_dict()
    else:
        model = _meta_model(cls, hf_config)
        full_state = {}
    parallelize(model)
    fill_from_rank0(model, full_state, device)
    return model


def fill_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Give a sharded `model` rank 0's weights and buffers; collective.

    Args:
        model: already parallelised (FSDP2 / tp / ep DTensors); on ranks > 0 its tensors may be on the meta
            device (they are materialised here).
        full_state: on rank 0, the unsharded state dict taken before sharding; ignored on the other ranks.
        device: where the meta tensors are materialised.
    """
    if dist.get_rank() != 0:
        full_state = {}
        if has_meta_tensors(model):
            model.to_empty(device=device)
    if stage_split(model) is not None:  # pipeline stages hold different keys: one tensor at a time, by name
        TorchStates(model, None).load_full_model_state(full_state)
        _broadcast_buffers_by_name(model)
        return  # (the split keeps tied embeddings itself)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True,
                                                                     broadcast_from_rank0=True))
    for buffer in model.buffers():  # includes non-persistent buffers, which no state dict carries
        dist.broadcast(buffer.data, src=0)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _broadcast_buffers_by_name(model: nn.Module) -> None:
    """Rank 0's buffers (non-persistent ones too, which no state dict carries) in every rank that holds one of the
    same name; collective (rank 0's list, one broadcast each)."""
    mine = dict(model.named_buffers())
    names = [(n, tuple(b.shape), b.dtype) for n, b in mine.items()] if dist.get_rank() == 0 else None
    for name, shape, dtype in collectives.gather_objects(names)[0]:
        buffer = mine.get(name)
        target = buffer.data if buffer is not None and tuple(buffer.shape) == shape else \
            torch.empty(shape, dtype=dtype, device=next(model.parameters()).device)
        dist.broadcast(target, src=0)
