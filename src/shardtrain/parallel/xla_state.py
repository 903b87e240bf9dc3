"""Checkpoint state on the XLA path, in the layout FSDP2 checkpoints have (see `parallel.states`).

The model's entries are read on the host: under SPMD one process holds every shard, so `.cpu()` of a sharded
parameter is the whole parameter and keys are the model's own names (the wrappers' `_orig_module.` removed):
a SPMD checkpoint is what an FSDP2 run of the same model writes, and `merge` / resume read it alike. Under the
v1 wrapper the entries are its own (sharded, possibly flattened) parameters, resumable on the same layout; its
full model (`save_model`, FULL_STATE_DICT) is consolidated in memory with torch_xla's
`consolidate_sharded_state_dicts` (never its pickled `.pth` files).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtrain.errors import CheckpointError
from shardtrain.parallel.states import EXTRA_RNG, clean_name, tied_aliases


def register_xla_rng() -> None:
    """Save and restore XLA's RNG with every checkpoint's rng_state (dropout on the device draws from it)."""
    import torch_xla.core.xla_model as xm

    EXTRA_RNG["xla"] = (lambda: str(xm.get_rng_state()),  # an unsigned 64-bit seed: kept as text
                        lambda saved: xm.set_rng_state(int(saved)))


def _copy_keeping_sharding(target: torch.Tensor, source: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """`target.copy_(source)` for an XLA tensor that keeps its sharding annotation (or takes that of `like`): a
    plain copy_ leaves it replicated (the resumed run would no longer be sharded, and would round differently)."""
    if target.device.type != "xla":
        target.copy_(source.to(target.device, target.dtype))
        return
    import torch_xla

    sharding = torch_xla._XLAC._get_xla_op_sharding(like if like is not None else target)
    target.copy_(source.to(target.device, target.dtype))
    if sharding is not None:
        torch_xla._XLAC._xla_clear_sharding(target)
        torch_xla._XLAC._xla_mark_sharding(target, sharding)


def _is_v1(model: nn.Module) -> bool:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    return isinstance(model, XlaFullyShardedDataParallel)


class XlaStates:
    """`TorchStates`' interface for a model wrapped by `XlaBackend` (SPMD v2 or v1)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 trainable_only: bool = False) -> None:
        self.model, self.optimizer, self.trainable_only = model, optimizer, trainable_only
        self.v1 = _is_v1(model)

    def _name(self, key: str) -> str:
        return key if self.v1 else clean_name(key)

    def _entries(self) -> dict[str, torch.Tensor]:
        return {self._name(k): v for k, v in self.model.state_dict(keep_vars=True).items()}

    def model_state(self) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self._entries().items()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._entries().items()}

    def tied_aliases(self) -> dict[str, str]:
        if self.v1:
            return {}
        return {clean_name(k): clean_name(v) for k, v in tied_aliases(self.model).items()}

    def load_model_state(self, state: dict[str, Any]) -> None:
        aliases = self.tied_aliases()
        done: set[int] = set()
        with torch.no_grad():
            for key, target in self._entries().items():
                if id(target) not in done:  # a tied weight once
                    _copy_keeping_sharding(target, state[key] if key in state else state[aliases[key]])
                    done.add(id(target))

    def full_model_state(self) -> dict[str, torch.Tensor]:
        if self.v1:
            from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

            full = dict(consolidate_sharded_state_dicts([self.model_state()], self.model.get_shard_metadata()))
            full = {clean_name(k): v for k, v in full.items()}
            for alias in tied_aliases(self.model.module):
                full.pop(clean_name(alias), None)
            return full
        full = self.model_state()
        for alias in self.tied_aliases():
            full.pop(alias, None)
        return full

    def load_full_model_state(self, full: dict[str, torch.Tensor]) -> None:
        if self.v1:
            raise CheckpointError("the XLA FSDP v1 wrapper resumes from its own sharded entries only: save with "
                                  "fsdp_config 'state_dict_type': 'SHARDED_STATE_DICT', or use 'xla_fsdp_v2': true")
        self.load_model_state(full)

    # -- optimizer: keyed by parameter name, as torch's get_optimizer_state_dict ----------------------
    def _param_names(self) -> dict[int, str]:
        return {id(p): self._name(n) for n, p in self.model.named_parameters()}

    def optimizer_state(self) -> dict[str, Any]:
        if not self.optimizer.state:  # the template DCP loads into needs every entry: make them (lr 0 step)
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self.optimizer)
        names = self._param_names()
        state = {names[id(p)]: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for p, s in self.optimizer.state.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, saved: dict[str, Any]) -> None:
        """Copy the saved entries into the live ones (the template for DCP made them with a zero-lr step,
        `optimizer_state`), sharded as an uninterrupted run has them: moments like their parameter."""
        names = self._param_names()
        by_name = {names[id(p)]: p for group in self.optimizer.param_groups for p in group["params"]}
        with torch.no_grad():
            for name, entry in saved["state"].items():
                param = by_name[name]
                live = self.optimizer.state[param]
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and isinstance(live.get(key), torch.Tensor):
                        # moments shaped like their parameter are sharded like it, as the step computes them
                        like = param if live[key].shape == param.shape else None
                        _copy_keeping_sharding(live[key], value, like)
                    else:
                        live[key] = value
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            if [names[id(p)] for p in group["params"]] != list(saved_group["params"]):
                raise CheckpointError("the checkpoint's optimizer parameter groups do not match this optimizer's; "
                                      "resume with the same model and optimizer settings")
            group.update({k: v for k, v in saved_group.items() if k != "params"})
