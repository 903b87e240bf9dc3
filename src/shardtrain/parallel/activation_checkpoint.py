"""Activation checkpointing of FSDP units: full (recompute the whole unit) or selective (per op, torchtitan's way).

    from shardtrain.parallel.activation_checkpoint import wrap_checkpointing
    units = wrap_checkpointing(model, units, "selective")   # before fully_shard, so FSDP hooks stay outside

    with ForwardResidue() as meter:                          # what a forward leaves alive for backward
        loss = model(**batch).loss
    meter.live_bytes()

Selective AC runs each unit under `torch.utils.checkpoint` (non-reentrant) with a `create_selective_checkpoint_
contexts` policy: the outputs of the ops that are expensive to recompute are kept for backward (matrix
products, attention kernels, collectives), every other op (norms, activations, adds, softmax, dropout, rotary,
casts) is recomputed in backward from them. Of the matrix multiplications (`mm`/`addmm`/`linear`) only every
second one is kept (the 1st, 3rd, ...): torchtitan's compromise. On `benchmarks/selective_ac.py`'s Llama a layer
keeps 0.36x the bytes of no checkpointing (full: 0.05x) for a third of full checkpointing's extra FLOPs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

_aten = torch.ops.aten

# Matrix products counted for the "every second one" rule (a Linear reaches the dispatcher as mm or addmm on
# CPU/CUDA; some backends keep aten.linear whole).
MM_OPS: frozenset = frozenset({_aten.mm.default, _aten.addmm.default, _aten.linear.default})


def _optional_ops(*paths: str) -> set:
    """Ops by dotted path under `torch.ops`, skipping those this build does not register (e.g. cuDNN on CPU)."""
    found = set()
    for path in paths:
        obj: Any = torch.ops
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        found.add(obj)
    return found


# Always kept: batched products (eager attention's scores and context), every SDPA kernel (its output and
# logsumexp; the CPU one is `_scaled_dot_product_flash_attention_for_cpu`), and collectives inside a unit
# (tensor/expert parallel), whose recomputation would mean communicating again in backward.
SAVED_OPS: frozenset = frozenset({_aten.bmm.default, _aten.baddbmm.default} | _optional_ops(
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "aten._scaled_mm.default",
    "aten._grouped_mm.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_to_all_single.default",
))


def selective_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh per-op policy for one checkpointed forward (its mm counter starts at zero for each unit call).

    Returns:
        `policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`: MUST_SAVE for `SAVED_OPS` and the odd-numbered
        matrix products of the forward, PREFER_RECOMPUTE for everything else.
    """
    count = {"mm": 0}

    def policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in MM_OPS:
            if ctx.is_recompute:  # torch may ask again while recomputing: the answer must not shift the count
                return CheckpointPolicy.PREFER_RECOMPUTE
            count["mm"] += 1
            return CheckpointPolicy.MUST_SAVE if count["mm"] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        if op in SAVED_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context() -> tuple[Any, Any]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint`: the SAC modes with a fresh `selective_policy`."""
    return create_selective_checkpoint_contexts(selective_policy())


def checkpoint_unit(module: nn.Module, mode: str) -> nn.Module:
    """`module` wrapped for activation checkpointing; `mode` is "full" or "selective".

    The RNG state is stashed in forward and restored for the recomputation (`preserve_rng_state`), so dropout
    draws the same masks in both and training equals training without checkpointing.
    """
    if mode == "full":
        return checkpoint_wrapper(module, preserve_rng_state=True)
    if mode == "selective":
        # checkpoint_wrapper uses the non-reentrant implementation, the one that takes a context_fn
        return checkpoint_wrapper(module, preserve_rng_state=True, context_fn=partial(selective_context))
    raise ValueError(f"activation checkpointing mode {mode!r}; expected 'full' or 'selective'")


def wrap_checkpointing(model: nn.Module, units: list[nn.Module], mode: str) -> list[nn.Module]:
    """Replace each unit in its parent by its checkpoint wrapper (`checkpoint_unit`); returns the wrappers, in
    the order of `units`."""
    wrapped: list[nn.Module] = []
    targets = {id(u) for u in units}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapper = checkpoint_unit(child, mode)
                parent.register_module(name, wrapper)
                wrapped.append(wrapper)
    order = {id(u): i for i, u in enumerate(units)}
    return sorted(wrapped, key=lambda w: order[id(w._checkpoint_wrapped_module)])


class ForwardResidue(TorchDispatchMode):
    """Measures what a forward leaves alive for backward: the bytes of the storages its ops created that are
    still alive (`live_bytes()`), deduplicated by storage, and how often each op ran (`ops`).

    Weak references only, so the meter keeps nothing alive. Saved-tensor hooks cannot see what selective
    checkpointing keeps (it caches op outputs itself, outside autograd's saved tensors); storages can.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops[func] += 1
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                storage = value.untyped_storage()
                known = self.storages.get(storage._cdata)
                if known is None or known[0].expired():  # a freed storage's address can be reused by a new one
                    self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        """Bytes of the storages created under this mode that are still alive."""
        return sum(size for ref, size in self.storages.values() if not ref.expired())
