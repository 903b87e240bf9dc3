"""What a checkpoint stores besides the model's tensors: the model's class and config, RNG states, the identity of
a frozen base (adapter checkpoints). (How the tensors are read: `shardtrain.parallel.states`.)

Pure functions shared by the checkpoint manager, the async save path and `Trainer.save_model`.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardtrain.checkpoint.layout import BASE_FILE
from shardtrain.parallel.states import EXTRA_RNG

# torch_xla's FSDP wrappers (v1 and SPMD) and v1's parameter flattener: each holds the model as `.module`
_WRAPPER_CLASSES = frozenset({"XlaFullyShardedDataParallel", "SpmdFullyShardedDataParallel", "XlaFlattenParamsWrapper"})


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch_xla's FSDP wrappers (the model itself otherwise)."""
    while type(model).__name__ in _WRAPPER_CLASSES and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def model_class(model: nn.Module) -> type:
    """The model's own class: `fully_shard` swaps the class for a generated `FSDP<Name>` subclass, and
    torch_xla's FSDP wraps the model."""
    cls = type(unwrap(model))
    if issubclass(cls, FSDPModule):
        bases = [base for base in cls.__bases__ if base is not FSDPModule]
        if bases and cls.__name__ == f"FSDP{bases[0].__name__}":
            return bases[0]
    return cls


def model_class_name(model: nn.Module) -> str:
    """The model's own class name (not FSDP's generated subclass)."""
    return model_class(model).__name__


def model_config_dict(model: nn.Module) -> dict[str, Any] | None:
    """The Hugging Face config of `model` as a dict, with `architectures` naming the model's class (what
    `save_pretrained` records); None for plain modules."""
    if callable(getattr(model, "get_base_model", None)):  # a PEFT model: the base model's config and class
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return None
    data = config.to_dict()
    data["architectures"] = [model_class_name(model)]
    return data


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors (loadable with weights_only=True)."""
    version, state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {"python": torch.tensor(state, dtype=torch.int64), "python_version": version, "python_gauss": gauss,
           "numpy": torch.from_numpy(np_keys.astype(np.int64)), "numpy_pos": int(np_pos),
           "numpy_has_gauss": int(np_has_gauss), "numpy_gauss": float(np_gauss), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    for name, (get, _) in EXTRA_RNG.items():
        out[name] = get()
    return out


def set_rng_state(saved: dict[str, Any]) -> None:
    random.setstate((saved["python_version"], tuple(saved["python"].tolist()), saved["python_gauss"]))
    np.random.set_state(("MT19937", saved["numpy"].numpy().astype(np.uint32), saved["numpy_pos"],
                         saved["numpy_has_gauss"], saved["numpy_gauss"]))
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    for name, (_, set_) in EXTRA_RNG.items():
        if name in saved:
            set_(saved[name])


def frozen_digests(model: nn.Module, rank: int = 0, world_size: int = 1) -> dict[str, str]:
    """SHA-256 of each frozen parameter's name, shape and values (as fp32, so a bf16 base and the same base loaded
    in fp32 hash alike); this rank hashes every `world_size`-th one (name order), so ranks share the work."""
    digests = {}
    frozen = sorted((name, param) for name, param in model.named_parameters() if not param.requires_grad)
    for name, param in frozen[rank::world_size]:
        tensor = param.detach().cpu()
        tensor = (tensor.float() if tensor.is_floating_point() else tensor).contiguous()
        digest = hashlib.sha256(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        digests[name] = digest.hexdigest()
    return digests


def frozen_identity(model: nn.Module, digests: dict[str, str] | None = None) -> dict[str, Any]:
    """Class of the (base) model and one SHA-256 over its frozen parameters' digests in name order (the same for
    any number of ranks). `digests`: all of them, when ranks computed them together (`frozen_digests`).

    Call it before sharding: the digests cover the full tensors.
    """
    digests = frozen_digests(model) if digests is None else digests
    combined = hashlib.sha256("".join(f"{name}={digests[name]}\n" for name in sorted(digests)).encode())
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return {"base_class": model_class_name(base), "frozen_sha256": combined.hexdigest()}


def base_problem(checkpoint: Path, identity: dict[str, Any] | None) -> str | None:
    """Why `checkpoint` cannot be loaded into a model whose frozen base is `identity` (None: adapters absent)."""
    path = checkpoint / BASE_FILE
    if identity is None and not path.is_file():
        return None
    if identity is None:
        return (f"{checkpoint} holds adapter weights only (see {BASE_FILE}) but this model has no adapters; pass "
                "the same peft_config (or PeftModel) as the run that wrote it")
    if not path.is_file():
        return (f"{checkpoint} holds a whole model, but this model has adapters; resume an adapter run from its "
                "own checkpoints, or load these weights into the base before adding adapters")
    saved = json.loads(path.read_text())
    if saved != identity:
        return (f"{checkpoint} was trained on base {saved.get('base_class')} with frozen weights "
                f"{str(saved.get('frozen_sha256'))[:12]}..., this model is {identity['base_class']} with "
                f"{identity['frozen_sha256'][:12]}...; load the same base model before adding the adapters")
    return None
