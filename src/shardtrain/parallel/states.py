"""How a parallelised model's state is read and written, the part of checkpointing that depends on the backend.

`TorchStates` serves FSDP2 (DTensor) and plain modules through `torch.distributed.checkpoint.state_dict`; the XLA
backend has its own (`shardtrain.parallel.xla_state`), and a backend names its class (`TrainingBackend.state_access`)
for the checkpoint manager. Both hand DCP the same layout: `{"model": {fqn: tensor}, "optimizer": {"state":
{fqn: ...}, "param_groups": ...}}` with the model's own parameter names (`clean_name`: without the wrappers'
prefixes; a tied weight under its first name), so `merge`, `from_pretrained` and resume do not care which backend
wrote it. `EXTRA_RNG` is where a backend registers RNG states of its own for the checkpoints' rng files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from shardtrain import model_facts

# Prefixes that wrappers add to parameter names: activation checkpointing, torch.compile, torch_xla's SPMD
# FSDP and its v1 wrapper. Checkpoints use the names without them.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_orig_module.", "_fsdp_wrapped_module.",
                    "_fpw_module.")

# name -> (get, set): RNG states beyond Python/NumPy/torch/CUDA that a backend registers (XLA's), saved in
# every rng_state file (values torch.load(weights_only=True) reads)
EXTRA_RNG: dict[str, tuple[Any, Any]] = {}


def clean_name(name: str) -> str:
    """`name` without wrapper prefixes (`WRAPPER_PREFIXES`)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """name -> first name of the same parameter, for parameters reachable under several names (names as saved:
    without the wrappers' prefixes)."""
    return {clean_name(alias): clean_name(name) for alias, name in model_facts.tied_aliases(model).items()}


def full_model_state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model (`trainable_only`: its trainable parameters) gathered on CPU on rank 0 (empty on other
    ranks); every rank must call it.

    A tied weight appears once, under its first name (`from_pretrained` re-ties the others from the config).
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=trainable_only))
    for alias in tied_aliases(model):
        state.pop(alias, None)
    return state


class TorchStates:
    """Model and optimizer state through `torch.distributed.checkpoint.state_dict` (FSDP2, DTensor, plain).

    Args:
        model / optimizer: what is saved and loaded (optimizer may be None).
        trainable_only: adapter training: only trainable parameters are saved, and loading leaves the frozen
            base as it is (its keys are absent by design).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 trainable_only: bool = False) -> None:
        self.model, self.optimizer, self.trainable_only = model, optimizer, trainable_only
        self._options = StateDictOptions(ignore_frozen_params=trainable_only)
        self._load_options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def model_state(self) -> dict[str, Any]:
        """This rank's part of the model, keyed by parameter name (DTensors under FSDP2)."""
        return get_model_state_dict(self.model, options=self._options)

    def optimizer_state(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_model_state(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=self._load_options)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)

    def load_full_optimizer_state(self, full: dict[str, Any]) -> None:
        """Load a whole optimizer state keyed by parameter name, given on every rank; each keeps its shard."""
        set_optimizer_state_dict(self.model, self.optimizer, full, options=StateDictOptions(full_state_dict=True))

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model on CPU on rank 0 (empty elsewhere); collective. A tied weight appears once."""
        return full_model_state(self.model, trainable_only=self.trainable_only)

    def load_full_model_state(self, full: dict[str, torch.Tensor]) -> None:
        """Load the whole model given on rank 0 (empty elsewhere) into every rank's shards; collective. A model
        that is not sharded (one plain process) loads through its own `load_state_dict`, as Hugging Face loads it,
        so a model that overrides it (to resize a buffer, say) is honoured."""
        if not any(isinstance(p, DTensor) for p in self.model.parameters()) and full:
            self.model.load_state_dict(full, strict=False)  # tied aliases are absent: one parameter, loaded once
            return
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False,
                                   ignore_frozen_params=self.trainable_only)
        set_model_state_dict(self.model, full, options=options)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The global shape of every saved model entry (what a checkpoint must match)."""
        return {k: tuple(v.shape) for k, v in self.model_state().items()}

    def tied_aliases(self) -> dict[str, str]:
        """name -> the name a tied weight is saved under."""
        return tied_aliases(self.model)
