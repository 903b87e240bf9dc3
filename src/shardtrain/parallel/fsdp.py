"""Apply FSDP2 to a model from outside: choose units, checkpoint activations, `fully_shard`, root last.

Order (as torchtitan's `parallelize_*`): activation checkpointing (full or selective) on each unit ->
`fully_shard` each unit (post-order, so nested units come first) -> one non-resharding unit for final norm +
lm_head (when `output_unit` asks for it; "auto": when the head is at least as big as a layer) -> root.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import Shard

from shardtrain.config import env
from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import FSDPConfigError
from shardtrain.model_facts import tied_parameter_ids
from shardtrain.parallel.activation_checkpoint import wrap_checkpointing
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.distributed import current_device
from shardtrain.parallel.expert import EP_FLAG, GRAD_RESCALE, expert_modules
from shardtrain.parallel.gloo_comms import AllToAllReduceScatter, gloo_reduce_scatter_choice

logger = logging.getLogger(__name__)

_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}



def _contains_tied(module: nn.Module, tied: set[int]) -> bool:
    return any(id(p) in tied for p in module.parameters())


def _layer_class_names(model: nn.Module, config: FSDPConfig) -> list[str]:
    names = list(config.transformer_layer_cls_to_wrap)
    if names:
        return names
    no_split = getattr(model, "_no_split_modules", None) or []
    if not no_split:  # as Accelerate: the root is the one FSDP unit (fine for small heads; big models name layers)
        warnings.warn(f"{type(model).__name__} declares no _no_split_modules and fsdp_config "
                      "'transformer_layer_cls_to_wrap' is empty: the whole model is one FSDP unit (all of it is "
                      "gathered in forward); name its layer class(es) there, e.g. "
                      f"{sorted({type(m).__name__ for m in model.modules()})[:8]}, to shard layer by layer",
                      stacklevel=3)
    return list(no_split)


def find_fsdp_units(model: nn.Module, config: FSDPConfig) -> list[nn.Module]:
    """Modules that become their own FSDP unit under `config.auto_wrap_policy` (root excluded), in post-order.

    Raises:
        FSDPConfigError: a requested layer class that the model does not contain.
    """
    if config.auto_wrap_policy == "NO_WRAP":
        return []
    tied = tied_parameter_ids(model)
    if config.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        wanted = _layer_class_names(model, config)
        present = {type(m).__name__ for m in model.modules()}
        missing = [name for name in wanted if name not in present]
        # `_no_split_modules` may list classes of other architectures in the same file; only explicit names must exist.
        if config.transformer_layer_cls_to_wrap and missing:
            raise FSDPConfigError(
                f"fsdp_config key 'transformer_layer_cls_to_wrap' names {missing} which "
                f"{type(model).__name__} does not contain; its classes are {sorted(present)}")
        if not config.transformer_layer_cls_to_wrap and wanted and len(missing) == len(wanted):
            raise FSDPConfigError(
                f"{type(model).__name__}._no_split_modules = {wanted} matches no module; set fsdp_config key "
                f"'transformer_layer_cls_to_wrap' to one of {sorted(present)}")
        units = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        return _post_order(model, [u for u in units if not _contains_tied(u, tied)])
    return _size_based_units(model, config.min_num_params, tied)


def _post_order(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    order = {id(m): i for i, m in enumerate(_modules_post_order(model))}
    return sorted(units, key=lambda m: order[id(m)])


def _modules_post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    for child in module.children():
        out.extend(_modules_post_order(child))
    out.append(module)
    return out


def _size_based_units(model: nn.Module, min_num_params: int, tied: set[int]) -> list[nn.Module]:
    """Bottom-up: a module is a unit when the parameters not already in a unit below it reach the threshold."""
    units: list[nn.Module] = []
    claimed: set[int] = set()
    for module in _modules_post_order(model):
        if module is model or isinstance(module, nn.ModuleList | nn.ModuleDict) or _contains_tied(module, tied):
            continue
        free = [p for p in module.parameters() if id(p) not in claimed]
        if free and sum(p.numel() for p in free) >= min_num_params:
            units.append(module)
            claimed.update(id(p) for p in free)
    return units


def output_unit(model: nn.Module, units: list[nn.Module], tied: set[int], config: FSDPConfig) -> list[nn.Module]:
    """Final norm + lm_head: used last in forward, first in backward, so one unit that stays gathered.

    With `output_unit: "auto"` (the default) only when the head has at least as many parameters as the
    smallest unit: a smaller head saves no memory as its own unit and costs a collective pair per step.
    Never for tied embeddings (they must stay in the unit of the input embedding) or without transformer wrapping.
    """
    if config.auto_wrap_policy != "TRANSFORMER_BASED_WRAP" or config.output_unit is False:
        return []
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None or not _numel([head]) or _contains_tied(head, tied) or any(head is u for u in units):
        return []  # (a pipeline stage without the head holds a parameterless stand-in)
    modules = [head]
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        for name in _FINAL_NORM_NAMES:
            norm = getattr(base, name, None)
            if isinstance(norm, nn.Module) and not any(norm is u for u in units) and not _contains_tied(norm, tied):
                modules.insert(0, norm)
                break
    if config.output_unit == "auto" and units and _numel(modules) < min(_numel([u]) for u in units):
        return []
    return modules


def _numel(modules: list[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit of a sharded model, root included."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard_all(model: nn.Module) -> None:
    """Free gathered parameters of every unit. Units that keep parameters after forward (root, head) stay
    gathered after a forward without backward (evaluation); optimizer and state-dict code expect shards."""
    for module in fsdp_modules(model):
        module.reshard()


def expert_shard_placement(experts: nn.Module, expert_mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard] | None:
    """How FSDP shards an experts module's fused weights over the expert-FSDP mesh: dim 0 (FSDP's default) while
    every shard gets at least one of this rank's experts, else dim 1 (torchtitan's rule). With more efsdp ranks
    than local experts, a dim-0 split leaves some ranks whole experts and others none (Qwen3-235B-A22B at ep 8 on
    512 ranks: 16 local experts over 64 efsdp ranks, 48 ranks with nothing and rank 0 at 4x its share)."""
    shard_ranks = expert_mesh.size(expert_mesh.ndim - 1)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in experts.parameters()]
    if all(t.ndim < 2 or t.shape[0] >= shard_ranks for t in local):
        return None
    return lambda param: Shard(1) if param.ndim >= 2 else Shard(0)


def set_explicit_prefetch(root: FSDPModule, units: list[FSDPModule]) -> None:
    """Prefetch along root -> `units` (sharded, in forward order: the post-order of stacked layers): a unit's
    pre-forward issues the all-gather of the next one, its pre-backward that of the previous one, so each gather
    can run while a unit computes. FSDP2 on its own gathers a unit only when it is reached in forward; in backward
    it prefetches one unit ahead already. A unit nested in another is left out (its parent's forward gathers it),
    and nothing prefetches the root in backward (it stays gathered from forward to backward)."""
    nested = {id(m) for unit in units for m in unit.modules() if m is not unit}
    chain = [root, *(unit for unit in units if id(unit) not in nested)]
    for current, following in zip(chain, chain[1:], strict=False):
        current.set_modules_to_forward_prefetch([following])
    for current, previous in zip(chain[2:], chain[1:], strict=False):
        current.set_modules_to_backward_prefetch([previous])


def fsdp_units(model: nn.Module, config: FSDPConfig) -> tuple[list[nn.Module], list[nn.Module]]:
    """The FSDP units the wrap policy picks (the blocks that activation checkpointing and compile work on too;
    experts `apply_ep` prepared are units of their own, left out) and the output head's unit (possibly empty)."""
    units = [unit for unit in find_fsdp_units(model, config) if not getattr(unit, EP_FLAG, False)]
    return units, output_unit(model, units, tied_parameter_ids(model), config)


def apply_activation_checkpointing(model: nn.Module, units: list[nn.Module], config: FSDPConfig) -> list[nn.Module]:
    """fsdp_config's activation checkpointing on each unit ("full" recomputes it; "selective" keeps matmul and
    attention outputs: `activation_checkpoint.py`); returns the units as FSDP then shards them."""
    if config.ac_mode == "none":
        return units
    if not units:
        raise FSDPConfigError("fsdp_config 'activation_checkpointing' needs FSDP units to checkpoint, but "
                              "auto_wrap_policy found none; use TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP")
    units = wrap_checkpointing(model, units, config.ac_mode)
    if getattr(getattr(model, "config", None), "use_cache", False):
        # A KV cache filled in forward would be filled again by the recomputation (as HF does for gradient
        # checkpointing, turn it off for training; generate still works, without cache reuse).
        model.config.use_cache = False
    return units


def apply_compile(model: nn.Module, units: list[nn.Module], compile_options: dict[str, Any] | None) -> None:
    """`torch.compile` each unit (torchtitan's way: one compiled block per unit, FSDP's hooks and collectives
    outside the graphs), in place (`nn.Module.compile`: names and state-dict keys stay); no units: one graph.
    None: eager."""
    if compile_options is None:
        return
    for unit in units or [model]:
        unit.compile(**compile_options)


def _policies(config: FSDPConfig, mesh: DeviceMesh, mixed_precision: str | None) -> dict[str, Any]:
    """`fully_shard`'s mesh, mixed-precision and offload arguments for `config`."""
    precision = mixed_precision or config.mixed_precision
    mp_policy = MixedPrecisionPolicy()
    if precision in _DTYPES:
        mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if config.cpu_offload \
        else OffloadPolicy()
    return {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}


def _gloo_reductions(model: nn.Module) -> None:
    """gloo has no AVG/PREMUL_SUM: reduce with SUM and divide afterwards; and its reduce-scatter is 2-3x slower than
    an all-to-all and a sum (parallel/gloo_comms.py)."""
    if dist.get_backend() != "gloo":
        return
    custom = AllToAllReduceScatter() if gloo_reduce_scatter_choice() == "all_to_all" else None
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
        if custom is not None:
            module.set_custom_reduce_scatter(custom)


def hook_mapping_outputs(module: FSDPModule) -> None:
    """FSDP2 (torch 2.13, 2.14) finds the output tensors whose backward starts a unit's backward in tuples,
    lists, dicts and dataclasses only: from a root returning another mapping (transformers' `BatchEncoding`, a
    `UserDict`: sentence-transformers' CrossEncoder) it hooks nothing, so the root never reduces the gradients
    nor reshards and the optimizer sees none. This registers FSDP's own pre-backward hook on such an output's
    tensors, as FSDP does on a dict's. (`FSDPState._pre_backward`: private, checked on torch 2.13 and 2.14.)"""
    from torch.distributed.fsdp._common_utils import collect_grad_tensors

    state = fully_shard.state(module)

    def after_forward(_: nn.Module, __: Any, output: Any) -> None:
        if isinstance(output, Mapping) and not isinstance(output, dict) and torch.is_grad_enabled():
            for tensor in collect_grad_tensors(dict(output)):
                tensor.register_hook(state._pre_backward)

    module.register_forward_hook(after_forward)


def shard_stage_root(root: nn.Module, fsdp_config: FSDPConfig, mesh: DeviceMesh, *,
                     mixed_precision: str | None = None) -> None:
    """`fully_shard` a pipeline stage's module (no parameters of its own, the sharded model inside) as the stage's
    FSDP root, with the model's policies: the pipeline schedule then reduces the gradients once per step."""
    fully_shard(root, **_policies(fsdp_config, mesh, mixed_precision))
    _gloo_reductions(root)


def apply_fsdp(
    model: nn.Module,
    fsdp_config: FSDPConfig | None = None,
    mesh: DeviceMesh | None = None,
    *,
    mixed_precision: str | None = None,
    expert_mesh: DeviceMesh | None = None,
    expert_grad_divide_factor: float | None = None,
    compile_options: dict[str, Any] | None = None,
    units: tuple[list[nn.Module], list[nn.Module]] | None = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2 according to `fsdp_config` and return it.

    Args:
        model: any module (Hugging Face models get `_no_split_modules` and `generate` support).
        fsdp_config: a parsed `FSDPConfig` (`FSDPConfig.load(dict | JSON path)` at the boundary); None: defaults.
        mesh: the mesh to shard over (`ParallelDims(...).build(...).fsdp`); default: every rank, as the
            config's sharding strategy says (1-D shard, or 2-D replicate x shard).
        mixed_precision: "bf16"/"fp16" overrides the config's `mixed_precision`.
        expert_mesh: the expert-FSDP mesh (`Meshes.efsdp`) for experts modules that `apply_ep` prepared; each
            becomes its own FSDP unit over it, inside the unit of its layer.
        expert_grad_divide_factor: what FSDP divides the experts' gradients by. An expert's gradient already
            sums the tokens of every rank of its ep group (the all-to-all's backward), so for the experts and
            the dense parameters to hold the same average it is the dense one: `ParallelDims.grad_average_size`.
        compile_options: `torch.compile` options (backend, mode) to compile each FSDP unit with, before it is
            sharded (torchtitan's way: one compiled block per unit, FSDP's hooks and collectives stay outside
            the graphs); None: eager.
        units: (units, head) that `fsdp_units` found and the earlier stages (`apply_activation_checkpointing`,
            `apply_compile`) prepared, as `apply_layout` stages them; None: those stages run here.

    Raises:
        FSDPConfigError: bad wrap settings.
    """
    if fsdp_config is not None and not isinstance(fsdp_config, FSDPConfig):
        raise TypeError(f"apply_fsdp takes an FSDPConfig, got {type(fsdp_config).__name__}; parse it first with "
                        "FSDPConfig.load(...)")
    config = fsdp_config or FSDPConfig()
    if not dist.is_initialized():
        raise RuntimeError("apply_fsdp needs a process group: call shardtrain.init_distributed() first")
    if mesh is None:  # data parallel over every rank, as the config's sharding strategy says
        dims = ParallelDims.resolve(world_size=dist.get_world_size(), fsdp_config=config,
                                    local_world_size=int(os.environ.get(env.LOCAL_WORLD_SIZE, dist.get_world_size())))
        mesh = dims.build(current_device().type).fsdp
    common = _policies(config, mesh, mixed_precision)

    if units is None:  # one call does every stage (the sharded loader, a user's script)
        units, head = fsdp_units(model, config)
        units = apply_activation_checkpointing(model, units, config)
        apply_compile(model, units, compile_options)
    else:
        units, head = units
    for experts in expert_modules(model):
        if expert_mesh is None:
            raise ValueError("apply_fsdp: the model has expert-parallel experts (apply_ep); pass expert_mesh")
        fully_shard(experts, reshard_after_forward=config.reshard_after_forward,
                    shard_placement_fn=expert_shard_placement(experts, expert_mesh), **{**common, "mesh": expert_mesh})
        if expert_grad_divide_factor is None:
            continue
        if expert_mesh.size(expert_mesh.ndim - 1) > 1:
            experts.set_gradient_divide_factor(expert_grad_divide_factor)
        else:  # with a one-rank reduce-scatter group and SUM-only reduction (gloo), FSDP2 (torch 2.13) divides by a
            # custom factor twice (the copy and the post-divide): keep its default divisor (the replicate size)
            # and let `rescale_expert_grads` apply the rest
            setattr(experts, GRAD_RESCALE, expert_mesh.size() / expert_grad_divide_factor)
    for unit in units:
        fully_shard(unit, reshard_after_forward=config.reshard_after_forward, **common)
    if head:
        fully_shard(head if len(head) > 1 else head[0], reshard_after_forward=False, **common)
    # The root keeps FSDP's default: it is not resharded after forward, since backward needs it at once.
    # (Passing reshard_after_forward=True here would free and all-gather the embedding again every step.)
    fully_shard(model, **common)
    hook_mapping_outputs(model)  # (the units are layers: their outputs are tensors and tuples)
    if config.forward_prefetch:
        set_explicit_prefetch(model, [*units, *head[:1]])  # a head of norm + lm_head is one unit (one state)

    _gloo_reductions(model)
    if callable(getattr(model, "generate", None)):
        register_fsdp_forward_method(model, "generate")
        for module in model.modules():  # a PEFT model's generate calls its base model's
            if callable(getattr(module, "generate", None)):
                # transformers' own flag for sharded models: generate then runs with synced_gpus, so a rank that
                # finished keeps running forwards (FSDP's collectives) until every rank has finished.
                module._is_fsdp_managed_module = True
    logger.info("FSDP2 applied: %d units + %s root, mesh %s", len(units), "head unit +" if head else "", mesh)
    return model
