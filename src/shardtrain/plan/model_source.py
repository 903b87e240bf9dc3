"""Where the planner's model comes from: a transformers `config.json`, a model directory, a config object or a
live `nn.Module`; each becomes a builder that makes the model on the meta device (no weights, no memory), which
`to_fake` turns into fake CPU tensors for the traced step. Adapters (LoRA) are added in between: peft cannot add
them to a model of fake tensors (its device move swaps parameters, which fake tensors refuse).

    build = model_builder("path/to/config.json")     # or a model directory, a PretrainedConfig, an nn.Module
    model = build()                                  # meta tensors
    with FakeTensorMode() as mode:
        model = to_fake(model, mode)
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardtrain.errors import PlanError


def _read_config(path: Path) -> Any:
    from transformers import AutoConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanError(f"model = {str(path)!r}: no such file; give a transformers config.json or a model directory "
                        "that holds one (nothing is downloaded)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise PlanError(f"model = {str(file)!r} is not valid JSON ({err}); give a transformers config.json") from err
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise PlanError(f"model = {str(file)!r} has no 'model_type' key; a transformers config.json names its "
                        "architecture there (e.g. \"model_type\": \"llama\")")
    model_type = raw.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except ValueError as err:
        raise PlanError(f"model = {str(file)!r}: 'model_type' {model_type!r} is not a transformers architecture "
                        f"({err})") from err


def _from_config(config: Any) -> Callable[[], nn.Module]:
    from transformers import AutoModelForCausalLM

    def build() -> nn.Module:
        if getattr(config, "use_cache", None):
            config.use_cache = False  # training: the Trainer never fills a KV cache
        # fp32 whatever the config's dtype says: the Trainer loads a model path in fp32 (parallel/loading.py);
        # bf16 is mixed precision on top
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            except ValueError:  # not a causal LM (e.g. an encoder): its base class, as in the config
                from transformers import AutoModel

                return AutoModel.from_config(config, dtype=torch.float32)
    return build


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _from_module(module: nn.Module) -> Callable[[], nn.Module]:
    """A deep copy whose parameters and buffers are meta tensors of the same shapes, dtypes and sharing."""

    def build() -> nn.Module:
        memo: dict[int, Any] = {}
        for param in module.parameters():
            if id(param) not in memo:  # tied parameters stay tied: one meta tensor per real one
                memo[id(param)] = nn.Parameter(_meta_like(param), requires_grad=param.requires_grad)
        for buffer in module.buffers():
            if id(buffer) not in memo:
                memo[id(buffer)] = _meta_like(buffer)
        return copy.deepcopy(module, memo)
    return build


def to_fake(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """`model` (meta tensors) with every parameter and buffer replaced, in place, by a fake CPU tensor of the
    same shape, dtype and `requires_grad`; tied ones stay tied."""
    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            with mode:
                new = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
            made[id(tensor)] = nn.Parameter(new, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, nn.Parameter) else new
        return made[id(tensor)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = fake(param)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = fake(buffer)
    return model


def model_builder(model: str | os.PathLike | nn.Module | Any) -> tuple[Callable[[], nn.Module], str]:
    """(a builder to call under `FakeTensorMode`, a name for the report) for `model`.

    Args:
        model: a transformers `config.json` path, a model directory holding one, a `PretrainedConfig`, or a live
            `nn.Module` (copied with fake parameters; the original is not touched).

    Raises:
        PlanError: a path that is not a readable transformers config, or an unsupported object.
    """
    if isinstance(model, nn.Module):
        return _from_module(model), type(model).__name__
    if isinstance(model, str | os.PathLike):
        config = _read_config(Path(model))
        return _from_config(config), f"{Path(model).name} ({config.model_type})"
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):
        return _from_config(copy.deepcopy(model)), f"{type(model).__name__}"
    raise PlanError(f"model = {type(model).__name__}: give a config.json path, a model directory, a transformers "
                    "PretrainedConfig or an nn.Module")
