"""Which checkpoint tensors fill which model tensors, by transformers' own conversion rules, and the sharded read of
the fused ones.

transformers 5 keeps per-expert keys in checkpoints (`model.layers.0.mlp.experts.3.gate_proj.weight`) and fuses them
into 3-D weights on load (`...mlp.experts.gate_up_proj`, (E, 2I, H)): `get_model_conversion_mapping(model)` lists,
for the model class, `WeightRenaming`s (a key under another name) and `WeightConverter`s (several keys, a chain of
operations). `plan_read` runs transformers' own `rename_source_key` on every key of the files, so that renamed keys
and fused groups are exactly the ones `from_pretrained` would build, in the same order (its `dot_natural_key` sort).

`read_fused` fills each rank's local shard of a fused parameter: the shard is a box in the parameter's global
coordinates (`DTensor.__create_chunk_list__`, what DCP itself uses), the box is followed back through the chain
(`Concatenate` along `dim`: which source and which columns; `MergeModulelist` along `dim`: which list entries, i.e.
which experts) to the slices of the source tensors that the rank needs, only those are read (`safe_open(...).
get_slice`), and the converter's own operations assemble them, so the result is what transformers would compute,
cut to the shard. Chains with any other operation cannot be followed slice by slice here: `plan_read` then says
why, and the caller keeps the rank-0 path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shardtrain.model_facts import tied_groups

try:  # transformers 5 (the tested 5.25): without it, only checkpoints whose keys match the model are read sharded
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )
except ImportError:  # pragma: no cover - the tests' transformers has it
    get_model_conversion_mapping = None


@dataclass
class FusedTarget:
    """One model tensor that a `WeightConverter` builds from several checkpoint tensors.

    Attributes:
        converter: a copy of transformers' converter for this tensor (it collects the tensors it is fed).
        sources: source pattern -> checkpoint keys, in the order transformers feeds them (its list positions).
        shapes: source pattern -> the shape of each of its checkpoint tensors.
    """

    converter: Any
    sources: dict[str, list[str]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class ReadPlan:
    """What to read for a model: `dense` checkpoint key -> model key (read through DCP), `fused` model key ->
    `FusedTarget` (read by `read_fused`), `files` checkpoint key -> its file."""

    dense: dict[str, str]
    fused: dict[str, FusedTarget]
    files: dict[str, Path]


def safetensors_index(path: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Key -> (file, shape) of every tensor in the directory's `*.safetensors` files (headers only)."""
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                index[key] = (file, tuple(handle.get_slice(key).get_shape()))
    return index



def plan_read(model: nn.Module, index: dict[str, tuple[Path, tuple[int, ...]]]) -> tuple[ReadPlan | None, str]:
    """Map the checkpoint's keys onto `model`'s state dict with transformers' conversion rules for its class.

    Args:
        model: the model on the meta device, before any sharding (global shapes).
        index: `safetensors_index` of the directory.

    Returns:
        (plan, "") when every model tensor is covered (a tied alias by its other name) and every fused group can be
        read slice by slice; otherwise (None, why). Checkpoint keys the model has no place for are ignored, as
        `from_pretrained` ignores them (with a warning).
    """
    state = model.state_dict()
    aliases = {name: names for names in tied_groups(model, buffers=True) for name in names}  # every name of each
    mapping = get_model_conversion_mapping(model) if get_model_conversion_mapping is not None else []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    dense: dict[str, str] = {}
    fused: dict[str, FusedTarget] = {}
    for key in sorted(index, key=dot_natural_key) if mapping else index:
        if mapping:  # transformers' own renaming, with its fallback for a key that needs no renaming
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
            if renamed not in state and key in state:
                renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=state)
        else:
            renamed, pattern = key, None
        if renamed not in state:
            continue
        shape = index[key][1]
        if pattern is None:
            if tuple(state[renamed].shape) != shape:
                return None, f"{renamed} has shape {tuple(state[renamed].shape)} in the model and {shape} in the files"
            if renamed in dense.values():
                return None, f"several checkpoint keys map to {renamed}"
            dense[key] = renamed
            continue
        target = fused.setdefault(renamed, FusedTarget(copy.deepcopy(pattern_to_converter[pattern])))
        target.sources.setdefault(pattern, []).append(key)
        if target.shapes.setdefault(pattern, shape) != shape:
            return None, f"the checkpoint tensors {pattern} of {renamed} differ in shape"
    filled = set(dense.values()) | set(fused)
    for key in state:
        if key not in filled and not any(alias in filled for alias in aliases.get(key, ())):
            return None, f"the files have no {key}" + (" (nor a conversion that builds it)" if mapping else "")
    for key, target in fused.items():
        why = _check_chain(target, tuple(state[key].shape))
        if why:
            return None, f"{key}: {why}"
    return ReadPlan(dense, fused, {key: file for key, (file, _) in index.items()}), ""


def _chain(target: FusedTarget) -> tuple[int, int | None] | str:
    """(stack dim, concatenation dim or None) of a `MergeModulelist[, Concatenate]` chain, or why it is not one."""
    ops = target.converter.operations
    names = [type(op).__name__ for op in ops]
    if (len(ops) not in (1, 2) or type(ops[0]) is not MergeModulelist
            or (len(ops) == 2 and type(ops[1]) is not Concatenate) or len(target.converter.target_patterns) != 1):
        return f"conversion {names} cannot be read slice by slice (only MergeModulelist[, Concatenate])"
    if len(ops) == 1 and len(target.sources) != 1:
        return f"conversion {names} with {len(target.sources)} source patterns"
    return ops[0].dim, ops[1].dim if len(ops) == 2 else None


def _merged_shapes(target: FusedTarget, stack: int) -> dict[str, list[int]]:
    """Source pattern -> the shape of its stacked tensor (MergeModulelist's `torch.stack` along `stack`)."""
    merged = {}
    for pattern in target.converter.source_patterns:
        if pattern in target.sources:
            shape = list(target.shapes[pattern])
            dim = stack % (len(shape) + 1)
            merged[pattern] = [*shape[:dim], len(target.sources[pattern]), *shape[dim:]]
    return merged


def _check_chain(target: FusedTarget, model_shape: tuple[int, ...]) -> str:
    chain = _chain(target)
    if isinstance(chain, str):
        return chain
    stack, cat = chain
    merged = list(_merged_shapes(target, stack).values())
    shape = list(merged[0])
    if cat is not None:
        dim = cat % len(shape)
        if any(len(m) != len(shape) or m[:dim] + m[dim + 1:] != shape[:dim] + shape[dim + 1:] for m in merged):
            return "its source tensors cannot be concatenated"
        shape[dim] = sum(m[dim] for m in merged)
    if tuple(shape) != model_shape:
        return f"the conversion builds shape {tuple(shape)}, the model has {model_shape}"
    return ""


def local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of this rank's part of `tensor`: a DTensor's local shard (FSDP, tp, ep, or several),
    as DCP sees it; a plain tensor is whole."""
    if hasattr(tensor, "__create_chunk_list__") and hasattr(tensor, "to_local"):
        chunks = tensor.__create_chunk_list__()
        if len(chunks) != 1:
            raise ValueError(f"a shard of {len(chunks)} pieces cannot be read as one box")
        return tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return (0,) * tensor.dim(), tuple(tensor.shape)


def _source_slices(target: FusedTarget, offsets: tuple[int, ...], sizes: tuple[int, ...],
                   ) -> dict[str, list[tuple[str, tuple[slice, ...], tuple[int, ...]]]]:
    """Source pattern -> [(checkpoint key, slice of it, slice shape)] that the box (offsets, sizes) needs, in the
    order the converter expects; a pattern the box does not reach along the concatenation dim gets zero-width
    slices (its position in the chain is kept)."""
    chain = _chain(target)
    if isinstance(chain, str):  # plan_read keeps only chains it can follow
        raise ValueError(chain)
    stack, cat = chain
    merged = _merged_shapes(target, stack)
    ndim = len(sizes)
    cat_dim = None if cat is None else cat % ndim
    start = 0
    out = {}
    for pattern, shape in merged.items():
        lo, hi = list(offsets), [o + s for o, s in zip(offsets, sizes)]
        if cat_dim is not None:  # the box's columns that fall into this source, in its own coordinates
            lo[cat_dim] = min(max(offsets[cat_dim] - start, 0), shape[cat_dim])
            hi[cat_dim] = max(min(offsets[cat_dim] + sizes[cat_dim] - start, shape[cat_dim]), lo[cat_dim])
            start += shape[cat_dim]
        dim = stack % ndim
        keys = target.sources[pattern][lo[dim]:hi[dim]]  # the list entries: for experts, this rank's experts
        inner = tuple(slice(a, b) for i, (a, b) in enumerate(zip(lo, hi)) if i != dim)
        inner_shape = tuple(b - a for i, (a, b) in enumerate(zip(lo, hi)) if i != dim)
        out[pattern] = [(key, inner, inner_shape) for key in keys]
    return out


@dataclass
class ReadStats:
    """What one rank read for the fused tensors: checkpoint keys and bytes (the files' dtype)."""

    keys: list[str] = field(default_factory=list)
    bytes: int = 0


def read_fused(model: nn.Module, path: Path, plan: ReadPlan) -> ReadStats:
    """Fill the local shards of `plan.fused` in `model` (materialised, already parallelised) from the files, reading
    only the slices each shard needs.

    Args:
        model: the parallelised model after `to_empty`.
        path: the checkpoint directory (for messages).
        plan: `plan_read`'s plan for this model.

    Returns:
        The checkpoint keys this rank read (each only in part where the shard needs part) and the bytes read.
    """
    state = model.state_dict()
    stats = ReadStats()
    with ExitStack() as files:
        handles: dict[Path, Any] = {}

        def handle(file: Path) -> Any:
            if file not in handles:
                handles[file] = files.enter_context(safe_open(str(file), framework="pt"))
            return handles[file]

        for key in plan.fused:
            param = state[key]
            local = param.to_local() if hasattr(param, "to_local") else param
            offsets, sizes = local_box(param)
            if tuple(local.shape) != sizes:
                raise ValueError(f"{path}: {key}'s local shard {tuple(local.shape)} is not its box {sizes}")
            if local.numel() == 0:  # an uneven FSDP split can leave a rank nothing of this tensor
                continue
            with torch.no_grad():
                local.copy_(read_box(plan, key, offsets, sizes, local.dtype, handle, stats, model))
    return stats


def read_box(plan: ReadPlan, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype,
             handle: Callable[[Path], Any], stats: ReadStats, model: nn.Module | None = None) -> torch.Tensor:
    """The box (`offsets`, `sizes`) of the fused model tensor `key`, read from its sources' slices and built by
    transformers' converter.

    Args:
        plan: `plan_read`'s plan.
        key: a key of `plan.fused`.
        offsets, sizes: the box in the tensor's global coordinates (not empty).
        dtype: the model's dtype; each slice is cast to it before converting, as transformers does.
        handle: file -> an open `safe_open` handle.
        stats: what is read is added to it.
        model: passed on to the converter (as `from_pretrained` does).
    """
    target = plan.fused[key]
    converter = copy.deepcopy(target.converter)  # it collects what it is fed: one per box
    for pattern, pieces in _source_slices(target, offsets, sizes).items():
        for source_key, box, shape in pieces:
            if 0 in shape:  # a source the box does not reach: its place in the chain, nothing read
                piece = torch.empty(shape, dtype=dtype)
            else:
                piece = handle(plan.files[source_key]).get_slice(source_key)[box]
                stats.keys.append(source_key)
                stats.bytes += piece.numel() * piece.element_size()
                piece = piece.to(dtype)
            # a callable is what transformers' synchronous loading feeds a converter
            converter.add_tensor(key, source_key, pattern, lambda piece=piece: piece)
    built = converter.convert(key, model=model, config=getattr(model, "config", None))
    if set(built) != {key}:
        raise ValueError(f"the conversion for {key} built {sorted(built)}")
    return built[key]
