"""Expert parallelism for mixture-of-experts models: each `ep` rank owns `num_experts / ep` of the routed experts.

    apply_ep(model, meshes.ep, meshes.tp)        # before apply_fsdp, which shards the experts over `efsdp`

The model's own expert-parallel plan decides what is an experts module (`config.base_model_ep_plan`: the
`ep_dispatch_experts` modules and their `grouped_gemm` fused 3-D weights, e.g. Qwen3-MoE's `gate_up_proj`
(E, 2I, H) and `down_proj` (E, H, I)). The token exchange is transformers' own (`AllToAllEP`, the `all_to_all`
entry of `EPImplementationInterface`): per-expert counts first, then the tokens, with PyTorch's autograd-aware
`all_to_all_single`; a rank whose experts get no token still runs them on an empty row, so its gradients exist and
FSDP's reduce-scatter runs. It works on gloo and nccl alike and computes the same function as the model's
own loop over experts (tested against one process).

What we do instead of transformers' `from_pretrained(distributed_config=...)`: the weights are real tensors
made DTensors `Shard(0)` on our `ep` mesh (transformers builds meta placeholders at load time), so FSDP2 can
shard them further over the expert-FSDP mesh, DCP saves them with their global shape (an ep 2 checkpoint
resumes under ep 1), and the full state dict has the model's own layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardtrain.errors import ExpertParallelError
from shardtrain.parallel.tensor import plan_matches, prefixed_plan

EP_FLAG = "_shardtrain_expert_parallel"  # set on experts modules; apply_fsdp shards them over the efsdp mesh
GRAD_RESCALE = "_shardtrain_grad_rescale"  # set by apply_fsdp where FSDP cannot apply the experts' divisor


def model_ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's own expert-parallel plan with full module / parameter names (`base_model_ep_plan`)."""
    return prefixed_plan(model, getattr(getattr(model, "config", None), "base_model_ep_plan", None))


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """{name: experts module} for every `ep_dispatch_experts` entry of the model's plan (empty: a dense model)."""
    plan = model_ep_plan(model)
    patterns = [pattern for pattern, style in plan.items() if style == "ep_dispatch_experts"]
    return {name: module for name, module in model.named_modules()
            if any(plan_matches(pattern, name) for pattern in patterns)}


def without_experts(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """`tp_plan` without the entries of the routed experts (under ep they are expert-parallel, not tensor-parallel:
    torchtitan's ETP = 1)."""
    experts = [pattern for pattern, style in model_ep_plan(model).items() if style == "ep_dispatch_experts"]
    return {pattern: style for pattern, style in tp_plan.items()
            if not any(pattern == e or pattern.startswith(e + ".") for e in experts)}


def check_ep(model: nn.Module, ep: int) -> dict[str, nn.Module]:
    """The experts modules `ep` can shard; refuses a dense model and an `ep` not dividing the experts.

    Raises:
        ExpertParallelError: naming the model class or the numbers.
    """
    experts = find_experts(model)
    if not experts:
        raise ExpertParallelError(
            f"ep_size = {ep}: {type(model).__name__} has no routed experts (no 'ep_dispatch_experts' entry in "
            "config.base_model_ep_plan); expert parallelism is for mixture-of-experts models such as "
            "Qwen3MoeForCausalLM, MixtralForCausalLM or OlmoeForCausalLM; set ep_size to 1")
    for name, module in experts.items():
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int):
            raise ExpertParallelError(f"ep_size = {ep}: {name} ({type(module).__name__}) has no integer num_experts; "
                                      "this experts module is not supported")
        if count % ep:
            raise ExpertParallelError(f"ep_size = {ep} does not divide the {count} experts of {name} "
                                      f"({type(model).__name__}); choose an ep_size that divides {count}")
        weights = _expert_weights(module, count)
        if not weights:
            raise ExpertParallelError(f"ep_size = {ep}: {name} ({type(module).__name__}) has no fused expert "
                                      f"weights with {count} experts in dim 0; this layout is not supported")
    return experts


def _expert_weights(module: nn.Module, count: int) -> list[str]:
    return [name for name, param in module.named_parameters(recurse=False)
            if param.dim() >= 2 and param.shape[0] == count]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh, *,
             ep_implementation: str = "all_to_all") -> list[str]:
    """Give each `ep` rank its experts (fused weights -> DTensor `Shard(0)` on `ep_mesh`) and route tokens to
    them with transformers' all-to-all dispatch; in place. Returns the experts modules' names.

    Args:
        model: a mixture-of-experts model with full (unsharded) weights, the same on every rank.
        ep_mesh: the 1-D expert-parallel mesh.
        tp_mesh: the ranks that hold the same batch (size 1: expert parallelism without tensor parallelism).
        ep_implementation: the `EPImplementationInterface` entry that exchanges the tokens (the planner registers
            its own, for fake tensors).

    Raises:
        ExpertParallelError: a dense model, sizes that do not divide, or a transformers without expert parallelism.
    """
    ep = ep_mesh.size()
    experts = check_ep(model, ep)
    try:
        from transformers.distributed.expert_parallel import EpDispatchExpertsParallel
    except ImportError as err:
        raise ExpertParallelError(f"ep_size = {ep} needs transformers' expert-parallel dispatch "
                                  f"(transformers.distributed.expert_parallel, transformers 5.25 is tested): {err}; "
                                  "upgrade transformers or set ep_size to 1") from None
    for module in experts.values():
        count = module.num_experts
        for name in _expert_weights(module, count):
            param = module._parameters[name]
            # The weights are identical on every rank (seeded or loaded): each keeps its slice, no broadcast.
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module._parameters[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        module.num_experts = count // ep  # the experts forward then runs this rank's experts on local ids
        module._is_expert_parallel = True
        EpDispatchExpertsParallel().install_forward(module, ep_mesh, tp_mesh=tp_mesh,
                                                    ep_implementation=ep_implementation)
        setattr(module, EP_FLAG, True)
    return list(experts)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules `apply_ep` prepared, in module order."""
    return [module for module in model.modules() if getattr(module, EP_FLAG, False)]


def rescale_expert_grads(model: nn.Module) -> None:
    """Multiply the experts' gradients by the factor `apply_fsdp` recorded (after backward, before clipping)."""
    for module in expert_modules(model):
        factor = getattr(module, GRAD_RESCALE, None)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()
                 if p.grad is not None]
        if factor is not None and factor != 1 and grads:
            torch._foreach_mul_(grads, factor)


def describe_experts(model: nn.Module) -> dict[str, Any]:
    """Facts for logs and tests: experts modules, their local expert count and weight shapes."""
    return {name: {"local_experts": module.num_experts,
                   "weights": {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}}
            for name, module in model.named_modules() if getattr(module, EP_FLAG, False)}
