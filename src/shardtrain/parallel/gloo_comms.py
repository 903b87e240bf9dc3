"""FSDP2's gradient reduce-scatter on gloo (CPU) as one all-to-all and a local sum.

    SHARDTRAIN_GLOO_REDUCE_SCATTER=native shardtrain launch --cpu ...   # keep gloo's own reduce-scatter

gloo's reduce-scatter is slow on CPU: measured here, 65.6 MB took 74 ms on 2 ranks and 164 ms on 4, while an
all-to-all of the same buffer followed by a sum of the received chunks took 30 and 50 ms (benchmarks/README.md,
"CPU efficiency"). Both send each rank the (n-1)/n of the buffer it reduces and hold one extra buffer of the input's
size while they run (gloo clones its input; the all-to-all receives into a new one), so memory does not change.
The sum over the received chunks runs in rank order: on 2 ranks the result is bit-identical to gloo's; on more
ranks it can differ in the last bit (another summation order). Installed with FSDP2's own extension point
(`FSDPModule.set_custom_reduce_scatter`) by `apply_fsdp` when the process group is gloo; NCCL is untouched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from shardtrain.config import env

CHOICES = ("all_to_all", "native")


def gloo_reduce_scatter_choice() -> str:
    """`SHARDTRAIN_GLOO_REDUCE_SCATTER`: "all_to_all" (default) or "native".

    Raises:
        env.EnvError: any other value.
    """
    choice = os.environ.get(env.GLOO_REDUCE_SCATTER, "").strip().lower() or CHOICES[0]
    if choice not in CHOICES:
        raise env.EnvError(f"environment variable {env.GLOO_REDUCE_SCATTER}={choice!r} is not one of "
                           f"{list(CHOICES)}; unset it (all_to_all) or set it to 'native' for gloo's reduce-scatter")
    return choice


class AllToAllReduceScatter(ReduceScatter):
    """Reduce-scatter with SUM as `all_to_all_single` + a sum of the received chunks; other ops go to
    `dist.reduce_scatter_tensor` (FSDP2 asks for SUM on gloo: `set_force_sum_reduction_for_comms`)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer, as FSDP2's default."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None:
        """Each rank's output is the sum over ranks of their input chunk at its own rank index."""
        if op != dist.ReduceOp.SUM or async_op:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(group.size(), -1), dim=0, out=output_tensor)
        return None
