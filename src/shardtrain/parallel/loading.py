"""Load a pretrained Hugging Face directory into a sharded model.

With `cpu_ram_efficient_loading`, only rank 0 reads the weights; the other ranks build the model on the
meta device (no memory), FSDP shards it, and the weights arrive by broadcast from rank 0. Buffers that are
not in the state dict (e.g. rotary `inv_freq`) are broadcast too; tied weights stay one parameter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.parallel.fsdp import apply_fsdp


def model_class_from_config(path: Path) -> type:
    """The transformers class named by `path`/config.json's `architectures` (default AutoModelForCausalLM)."""
    config = json.loads((path / "config.json").read_text())
    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def load_pretrained(path: str | Path, fsdp_config: FSDPConfig | None, *, model_class: type | None = None,
                    mixed_precision: str | None = None, device: torch.device | None = None,
                    mesh: DeviceMesh | None = None, compile_options: dict | None = None) -> nn.Module:
    """Load `path` (config.json + weights) and shard it with FSDP2 (`fsdp_config` None: no sharding).

    Args:
        path: a directory written by `save_pretrained`, `Trainer.save_model` or `shardtrain merge`.
        fsdp_config: FSDP settings; `cpu_ram_efficient_loading` selects rank-0-only reading.
        model_class: the class to instantiate; default from `config.json`'s `architectures`.
        mixed_precision: passed on to `apply_fsdp`.
        device: where parameters live (default CPU).
        mesh: the mesh to shard over (default: `apply_fsdp`'s, from the config).
        compile_options: passed on to `apply_fsdp` (torch.compile per FSDP unit).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a directory saved by save_pretrained/save_model")
    cls = model_class or model_class_from_config(path)
    device = device or torch.device("cpu")
    config = fsdp_config
    if config is None or not config.cpu_ram_efficient_loading:
        model = cls.from_pretrained(str(path), dtype=torch.float32).to(device)
        if config is None:
            if compile_options is not None:
                model.compile(**compile_options)
            return model
        return apply_fsdp(model, config, mesh, mixed_precision=mixed_precision, compile_options=compile_options)

    rank = dist.get_rank()
    if rank == 0:
        model = cls.from_pretrained(str(path), dtype=torch.float32).to(device)
        full_state = model.state_dict()
    else:
        hf_config = transformers.AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = cls._from_config(hf_config, dtype=torch.float32)
        full_state = {}
    apply_fsdp(model, config, mesh, mixed_precision=mixed_precision, compile_options=compile_options)
    if rank != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True,
                                                                     broadcast_from_rank0=True))
    del full_state
    for buffer in model.buffers():  # includes non-persistent buffers, which no state dict carries
        dist.broadcast(buffer.data, src=0)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model
