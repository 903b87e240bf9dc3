"""The routers' load-balancing loss of mixture-of-experts models, over the global batch.

transformers' `load_balancing_loss_func` (Switch Transformer, eqs. 4-6) multiplies two per-expert statistics of
the batch: the fraction of (token, top-k slot) assignments each expert got, and its mean routing probability.
Computed per rank it would depend on how the batch is split, so here both statistics are summed over the ranks
of the `loss` mesh first: the assignment counts and the token count with one small all-reduce (they carry no
gradient), the probabilities stay local and differentiable. Rank r then contributes

    aux_r = E * sum_e f_e * P_e,r / N          f_e = global assignments of e / N,  N = global (unpadded) tokens,

and the ranks' contributions add up to the one-process value of the whole global batch, gradients included.

Under gradient accumulation the statistics are those of one micro-step (every rank's micro-batch of it), and a
step's loss takes their mean over its micro-steps: the same as one process running the same micro-steps. (A
value over the whole step would need every micro-step's routing before the first backward.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RouterLoss:
    """Load-balancing loss of a model whose config asks for it (`output_router_logits` and a non-zero
    `router_aux_loss_coef`, as transformers' MoE models add it to their loss); `enabled` is False otherwise."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        config = getattr(model, "config", None)
        self.coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        self.num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        self.top_k = getattr(config, "num_experts_per_tok", None)
        self.enabled = bool(getattr(config, "output_router_logits", False)) and self.coef > 0 and \
            isinstance(self.num_experts, int) and isinstance(self.top_k, int)
        self.group = group

    def local_share(self, outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's share of `coef * aux` for one micro-step (collective over the loss group).

        Raises:
            ValueError: the model returned no router logits although its config asks for them.
        """
        router_logits = getattr(outputs, "router_logits", None)
        if not router_logits:
            raise ValueError(f"config.output_router_logits is set but {type(outputs).__name__} has no router_logits; "
                             "set config.output_router_logits = False to train without the load-balancing loss")
        mask = batch.get("attention_mask")
        counts = torch.zeros(self.num_experts + 1, dtype=torch.float64, device=router_logits[0].device)
        prob_sum = torch.zeros(self.num_experts, dtype=torch.float32, device=router_logits[0].device)
        weight = None if mask is None else mask.reshape(-1, 1).to(torch.float32)
        for layer_logits in router_logits:
            probs = F.softmax(layer_logits.float(), dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            hits = F.one_hot(chosen, self.num_experts).sum(dim=1).to(torch.float32)  # (tokens, experts)
            if weight is not None:
                hits, probs = hits * weight, probs * weight
            counts[:-1] += hits.sum(dim=0).detach().to(torch.float64)
            prob_sum = prob_sum + probs.sum(dim=0)
            counts[-1] += layer_logits.shape[0] if weight is None else weight.sum().to(torch.float64)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)
        rows = counts[-1].clamp(min=1)
        fraction = (counts[:-1] / rows).to(prob_sum.dtype)
        return self.coef * self.num_experts * (fraction * prob_sum).sum() / rows.to(prob_sum.dtype)
