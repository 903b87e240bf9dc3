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
import torch.distributed as dist
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
from shardtrain.parallel import collectives
from shardtrain.parallel.pipeline_split import published_aliases, stage_split

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
    without the wrappers' prefixes); a pipeline's last stage: its head, when tied to the first stage's embedding."""
    aliases = {clean_name(alias): clean_name(name) for alias, name in model_facts.tied_aliases(model).items()}
    split = stage_split(model)
    if split is not None and split.tied_names is not None:  # the whole model's pair, whichever half this stage holds
        embedding, head = split.tied_names
        aliases[head] = embedding
    return aliases


def full_model_state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model (`trainable_only`: its trainable parameters) gathered on CPU on rank 0 (empty on other
    ranks); every rank must call it. Under a pipeline, each stage's part is gathered on its first rank and sent
    to rank 0.

    A tied weight appears once, under its first name (`from_pretrained` re-ties the others from the config).
    """
    split = stage_split(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=split is None,
                                                                 ignore_frozen_params=trainable_only))
    for alias in tied_aliases(model):
        state.pop(alias, None)
    return state if split is None else gather_stages(model, state)


def gather_stages(model: nn.Module, stage_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's `stage_state` (whole tensors of its part, as each of its ranks holds them) joined on
    rank 0 (empty elsewhere); collective. Each stage's first rank sends its part (in memory, between this run's
    own ranks)."""
    split = stage_split(model)
    rank, per_stage = dist.get_rank(), dist.get_world_size() * len(split.held) // split.stages
    mine = {k: v.detach().cpu() for k, v in stage_state.items()} if rank % per_stage == 0 else {}
    parts = collectives.gather_objects(mine)
    return {k: v for part in parts for k, v in part.items()} if rank == 0 else {}


def whole_model_keys(model: nn.Module, keys: set[str]) -> set[str]:
    """`keys` (this rank's) joined with every pipeline stage's; without a pipeline, `keys` (collective under a
    pipeline)."""
    if stage_split(model) is None:
        return keys
    return set().union(*collectives.gather_objects(sorted(keys)))


def _load_full_by_key(model: nn.Module, full: dict[str, torch.Tensor], trainable_only: bool) -> None:
    """A pipeline stage's share of a whole model given on rank 0: rank 0 broadcasts one tensor at a time (all
    ranks, one order), each stage keeps the keys it holds and loads them into its shards."""
    wanted = set(get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only)))
    wanted |= {published for published, own in published_aliases(model).items() if own in wanted}
    own = {published: name for published, name in published_aliases(model).items()}
    specs = [(k, tuple(v.shape), v.dtype) for k, v in sorted(full.items())] if dist.get_rank() == 0 else None
    specs = collectives.gather_objects(specs)[0]
    device = next(model.parameters()).device
    mine: dict[str, torch.Tensor] = {}
    for key, shape, dtype in specs:
        tensor = full[key].to(device) if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype, device=device)
        collectives.broadcast(tensor, src=0)
        if key in wanted:
            mine[own.get(key, key)] = tensor
    set_model_state_dict(model, mine, options=StateDictOptions(full_state_dict=True, strict=False,
                                                               ignore_frozen_params=trainable_only))


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
        self._published = published_aliases(model)  # checkpoint name -> own name (a pipeline's tied head)

    def model_state(self) -> dict[str, Any]:
        """This rank's part of the model, keyed by parameter name (DTensors under FSDP2); a pipeline stage's
        half of tied embeddings also under the embedding's name (`pipeline_split.published_aliases`)."""
        state = get_model_state_dict(self.model, options=self._options)
        for published, own in self._published.items():
            if own in state:
                state[published] = state[own]
        return state

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state by parameter name; a pipeline stage's half of tied embeddings under the
        embedding's name."""
        state = get_optimizer_state_dict(self.model, self.optimizer)
        self._own_groups = [list(group["params"]) for group in state["param_groups"]]
        renamed = {own: published for published, own in self._published.items()}
        if renamed:
            state["state"] = {renamed.get(k, k): v for k, v in state["state"].items()}
            for group in state["param_groups"]:
                group["params"] = [renamed.get(k, k) for k in group["params"]]
        return state

    def load_model_state(self, state: dict[str, Any]) -> None:
        for published, own in self._published.items():
            value = state.pop(published, None)  # (the same tensor as its own name's, or the one to load)
            if own not in state and value is not None:
                state[own] = value
        if stage_split(self.model) is not None:  # the whole model's tied names this stage does not hold (a rank
            # holding both ends, under a V-shaped schedule, holds the pair as one process does: both names)
            local = {clean_name(name) for name in self.model.state_dict(keep_vars=True)}
            for alias in tied_aliases(self.model):
                if alias not in local:
                    state.pop(alias, None)
        set_model_state_dict(self.model, state, options=self._load_options)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load an `optimizer_state()` that a checkpoint filled. The groups' hyperparameters are the checkpoint's,
        their parameter lists this optimizer's own: a checkpoint written by pipeline stages holds one stage's
        lists (each stage's parameters differ; the hyperparameters do not)."""
        own = getattr(self, "_own_groups", None)
        if own is not None and len(own) == len(state["param_groups"]):
            for group, names in zip(state["param_groups"], own, strict=True):
                group["params"] = names
        state["state"] = {self._published.get(k, k): v for k, v in state["state"].items()}
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
        if stage_split(self.model) is not None:
            _load_full_by_key(self.model, full, self.trainable_only)
            return
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
