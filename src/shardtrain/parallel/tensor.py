"""Tensor parallelism for dense models: the model's own plan, applied with PyTorch's `parallelize_module`.

    apply_tp(model, meshes.tp)                        # before apply_fsdp (order: TP -> checkpointing -> FSDP)
    apply_tp(model, meshes.tp, {"layers.*.mlp.down_proj": "rowwise", ...})

The plan is transformers' (`config.base_model_tp_plan` under the base model, `_tp_plan` for `lm_head`): module-name
patterns (`*` matches one name) -> style strings. Each string becomes the PyTorch `ParallelStyle` with the layouts
transformers' own registry gives it (`transformers/distributed/tensor_parallel.py`), so the sharding is the one
the model authors planned, but the parameters are plain PyTorch DTensors on our `tp` mesh: FSDP2 shards them over
the `fsdp` mesh as 2-D DTensors, DCP saves and reshards them, and a run resumes (transformers' own TP path is tied
to `from_pretrained(tp_plan=...)` and cannot resume). `replicated_with_grad_allreduce` (Qwen3's per-head norms)
becomes a Replicate-weight module on a heads-sharded input, so DTensor sums its partial gradients. The routed
experts' styles (`packed_colwise`, `moe_tp_experts`) are left out under expert parallelism (the experts are
ep-sharded instead) and refused without it. Tied input/output embeddings are left replicated (one weight, two
modules).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from shardtrain.errors import TensorParallelError
from shardtrain.model_facts import tied_embedding_modules


def _style(name: str) -> ParallelStyle | None:
    """PyTorch's ParallelStyle for a transformers plan string (transformers' layouts), None if unsupported."""
    styles = {
        "colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)),
        "colwise_gather_output": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "rowwise": lambda: RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # nn.Embedding under RowwiseParallel: vocabulary rows sharded, masked lookup, partial sums all-reduced
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "replicated_with_grad_allreduce": ReplicatedOverLocalHeads,
    }
    make = styles.get(name)
    return make() if make is not None else None


SUPPORTED_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep",
                    "embedding_rowwise", "replicated_with_grad_allreduce")


EXPERT_STYLES = ("packed_colwise", "moe_tp_experts", "grouped_gemm", "ep_dispatch_experts")


class ReplicatedOverLocalHeads(ParallelStyle):
    """transformers' `replicated_with_grad_allreduce` (Qwen3's per-head `q_norm` / `k_norm`): a norm between a
    colwise and a rowwise layer sees this rank's heads only. Its weight becomes a `Replicate` DTensor and its
    input a `Shard` over the heads dimension (the one before last), so DTensor sums the weight's partial
    gradients over the tp ranks by itself; the output goes back to a local tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            first = inputs[0]
            return (DTensor.from_local(first, mesh, [Shard(first.dim() - 2)], run_check=False), *inputs[1:])

        def to_local(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan with full module names: `base_model_tp_plan` (under the base model) + `_tp_plan`."""
    plan = prefixed_plan(model, getattr(getattr(model, "config", None), "base_model_tp_plan", None))
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def prefixed_plan(model: nn.Module, base_plan: dict[str, str] | None) -> dict[str, str]:
    """A plan of the base model (transformers' `base_model_*_plan`) with full names under `model`."""
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    return {f"{prefix}.{pattern}" if has_prefix else pattern: style for pattern, style in (base_plan or {}).items()}


def plan_matches(pattern: str, name: str) -> bool:
    """Whether a plan pattern (`*` = one name) matches a module name."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def check_tp_sizes(model: nn.Module, tp: int) -> None:
    """Refuse a `tp` that does not divide the attention heads, K/V heads or the MLP width.

    Raises:
        TensorParallelError: naming the size that `tp` does not divide.
    """
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % tp:
            raise TensorParallelError(f"tp_size = {tp} does not divide the model's {key} = {value}; choose a tp_size "
                                      f"that divides it")


def refuse_replicated_experts(model: nn.Module, tp: int) -> None:
    """Routed experts are not tensor-parallel here: without expert parallelism they would stay whole on every tp
    rank (the model's own plan may not name them at all).

    Raises:
        TensorParallelError: always, with the fix.
    """
    raise TensorParallelError(
        f"tp_size = {tp}: {type(model).__name__}'s routed experts are not tensor-parallel here; add expert "
        "parallelism (ep_size > 1, e.g. ep_size = tp_size): the experts are then spread over the ep ranks and only "
        "attention and dense layers are tensor-parallel")


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: dict[str, str] | None = None,
             strict: bool | None = None) -> dict[str, str]:
    """Shard `model`'s planned linear layers over the 1-D `tp` mesh, in place; returns {module name: style}.

    `strict` (default: a plan was given) refuses a pattern that matches no module; the model's own plan may name
    modules some configurations do not build (e.g. the dense MLP of an MoE model's `mlp_only_layers`).

    Raises:
        TensorParallelError: no plan, an unsupported style, a pattern that matches nothing, or sizes `tp`
            does not divide.
    """
    strict = plan is not None if strict is None else strict
    plan = dict(plan) if plan is not None else model_tp_plan(model)
    if not plan:
        raise TensorParallelError(
            f"tp_size = {mesh.size()}: {type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan / "
            f"_tp_plan); pass one as TrainingArguments(tp_plan={{'model.layers.*.self_attn.q_proj': 'colwise', ...}})")
    check_tp_sizes(model, mesh.size())
    tied = tied_embedding_modules(model)
    chosen: dict[str, Any] = {}
    names = [name for name, _ in model.named_modules()]
    # another pipeline stage's modules (`pipeline_split.Skipped`): matched by the plan, left alone
    skipped = {name for name, module in model.named_modules() if getattr(module, "pipeline_skipped", False)}
    for pattern, style_name in plan.items():
        style = _style(style_name)
        if style is None and style_name in EXPERT_STYLES and not strict:
            raise TensorParallelError(
                f"tp_size = {mesh.size()}: {type(model).__name__}'s routed experts ({pattern!r}: {style_name!r}) are "
                "not tensor-parallel here; add expert parallelism (ep_size > 1, e.g. ep_size = tp_size): the experts "
                "are then spread over the ep ranks and only attention and dense layers are tensor-parallel")
        if style is None:
            raise TensorParallelError(f"tensor-parallel plan entry {pattern!r}: style {style_name!r} is not supported; "
                                      f"use one of {list(SUPPORTED_STYLES)}")
        found = [name for name in names if plan_matches(pattern, name)]
        if not found and strict:
            raise TensorParallelError(f"tensor-parallel plan entry {pattern!r} matches no module of "
                                      f"{type(model).__name__}; module names look like {names[1:4]}")
        for name in found:
            if name in tied or name in skipped:
                continue  # one weight in two modules: left replicated
            chosen[name] = (style, style_name)
    parallelize_module(model, mesh, {name: style for name, (style, _) in chosen.items()})
    return {name: style_name for name, (_, style_name) in chosen.items()}

