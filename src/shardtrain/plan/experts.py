"""Mixture-of-experts under the planner's fake tensors: grouped matmuls, their FLOPs, and expert parallelism's
token exchange under uniform routing.

Two things stop a traced MoE step that a real one does not meet:
- PyTorch's meta kernel of `aten._grouped_mm` (transformers' default experts implementation) checks CUDA's dtype
  rule (bf16 only), although the CPU kernel the fake tensors stand for takes fp32. `GroupedMmShapes` gives the
  output its shape without that check; the shape rule is PyTorch's own (`_create_grouped_mm_output_tensor`).
- transformers' all-to-all dispatch (`AllToAllEP`) reads the per-rank token counts back to the host, and fake
  tensors have no values. `UniformAllToAll` is that dispatch with the counts of uniform routing: every rank sends
  each expert rank the same share of its (token, expert) pairs and every local expert gets the same share of what
  arrives. Real routing is not uniform, so the experts' activations on a rank are a prediction for a balanced
  router (a router trained with a load-balancing loss is close to it; a fresh one is not exactly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

UNIFORM_EP = "shardtrain_plan_uniform"  # the EPImplementationInterface name apply_ep uses when planning


class GroupedMmShapes(TorchDispatchMode):
    """Fake outputs for `aten._grouped_mm` without the CUDA-only bf16 check of its meta kernel."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            from torch._meta_registrations import _create_grouped_mm_output_tensor

            mat_a, mat_b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
            return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return func(*args, **kwargs)


def grouped_mm_flops(mat_a: Any, mat_b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of `aten._grouped_mm` (shapes only): each output element contracts over its group's slice. 2-D x 2-D
    (a weight gradient, groups along the contracted dim) contracts over the whole dim once per output row set."""
    contracted = mat_a[-1]
    out = 1
    for size in out_shape:
        out *= size
    if len(mat_a) == 2 and len(mat_b) == 2:
        return 2 * out * contracted // out_shape[0]
    return 2 * out * contracted


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def register_uniform_all_to_all() -> str:
    """Register `UniformAllToAll` with transformers' `EPImplementationInterface`; returns its name."""
    from transformers.distributed.expert_parallel import AllToAllEP, EPImplementationInterface, _AllToAllState
    from transformers.distributed.parallel_utils import _WaitTensor

    if UNIFORM_EP in EPImplementationInterface():
        return UNIFORM_EP

    class UniformAllToAll(AllToAllEP):
        """transformers' `AllToAllEP` with the split sizes of uniform routing instead of the ones read back from
        the device: the same tensors, collectives and shapes, for a balanced router."""

        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN202
            from torch.distributed import all_to_all_single
            from torch.distributed._functional_collectives import all_to_all_single_autograd
            from torch.distributed.tensor import Replicate, Shard

            num_tokens = hidden_states.size(0)
            if self.tp_mesh.size() > 1:
                hidden_states, top_k_index, top_k_weights = (
                    DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                    .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                    for t in (hidden_states, top_k_index, top_k_weights))
            group, ep_size = self.ep_mesh.get_group(), self.ep_mesh.size()
            num_top_k = top_k_index.size(-1)
            expert_ids = top_k_index.reshape(-1)
            order = torch.argsort(expert_ids)
            send_tokens = hidden_states[order // num_top_k]
            counts = torch.zeros(self.num_local_experts * ep_size, dtype=torch.long, device=hidden_states.device)
            counts = counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids)).view(ep_size, -1)
            all_to_all_single(torch.empty_like(counts), counts, group=group)  # the counts' exchange, as AllToAllEP
            # uniform routing: every rank sends each expert rank the same share of its pairs, so this rank gets
            # its own share from each sender
            send_sizes = _even(expert_ids.numel(), ep_size)
            mine = send_sizes[self.ep_mesh.get_local_rank()]
            recv_sizes = [mine] * ep_size
            recv_tokens = _WaitTensor.apply(all_to_all_single_autograd(send_tokens, recv_sizes, send_sizes, group))
            per_expert = torch.tensor(_even(sum(recv_sizes), self.num_local_experts), device=hidden_states.device)
            recv_expert_ids = torch.arange(self.num_local_experts, device=hidden_states.device).repeat_interleave(
                per_expert, output_size=sum(recv_sizes)).unsqueeze(-1)
            recv_weights = torch.ones_like(recv_expert_ids, dtype=recv_tokens.dtype)
            state = _AllToAllState(top_k_weights, order, send_sizes, recv_sizes, num_tokens)
            return recv_tokens, recv_expert_ids, recv_weights, state

    EPImplementationInterface.register(UNIFORM_EP, UniformAllToAll)
    return UNIFORM_EP
