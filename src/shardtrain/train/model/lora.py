"""LoRA through the `peft` library: adapters added before FSDP, adapter files built from every rank's shard.

    trainer = Trainer(model, args, train_dataset=ds, peft_config=LoraConfig(r=8, target_modules=["q_proj"]))
    trainer.train()
    trainer.save_model("out/adapter")                          # adapter_model.safetensors + adapter_config.json
    trainer.save_model("out/merged", merge_adapters=True)      # a plain transformers model (merge_and_unload)

Adapters live in the FSDP unit of their block, next to the frozen base weights (FSDP2 shards frozen and
trainable parameters of one unit together); the optimizer holds only the adapters. Checkpoints of a PEFT model
hold the trainable parameters only and record the frozen base's identity (`base_model.json`: class and a SHA-256
of the frozen weights, computed once before sharding), so resuming on a different base is refused.
"""

from __future__ import annotations

import copy as copy_module
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.errors import PeftError
from shardtrain.model_facts import tied_aliases

ADAPTER_CONFIG = "adapter_config.json"  # peft's file name


def require_peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise PeftError("LoRA needs the peft library: pip install 'shardtrain[peft]' (or pip install peft)") from err
    return peft


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a `peft.PeftModel` (also after `fully_shard`, which subclasses it)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def add_adapters(model: nn.Module, peft_config: Any) -> nn.Module:
    """`peft.get_peft_model(model, peft_config)`: the base frozen, the adapters trainable.

    Raises:
        PeftError: peft is missing, or `model` already has adapters.
    """
    peft = require_peft()
    if is_peft_model(model):
        raise PeftError("Trainer got a PeftModel and a peft_config; pass one of them (the PeftModel already has "
                        "its adapters)")
    return peft.get_peft_model(model, peft_config)


def adapter_files(model: nn.Module) -> dict[str, str]:
    """Files every adapter checkpoint carries: adapter_config.json (what `shardtrain merge --merge-lora` and peft
    need to rebuild the adapted model); empty for a model without adapters."""
    if not is_peft_model(model):
        return {}
    config = model.peft_config[model.active_adapter].to_dict()
    return {ADAPTER_CONFIG: json.dumps(config, indent=2, sort_keys=True, default=_jsonable)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    return str(value)


def stage_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapter weights, whole, as peft names them in adapter_model.safetensors; collective
    over the stage's ranks."""
    from peft import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    trainable = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    return get_peft_model_state_dict(model, state_dict=trainable)


def write_adapter(model: nn.Module, trainable_state: dict[str, torch.Tensor], out: Path, picked: bool = False) -> None:
    """adapter_model.safetensors + adapter_config.json from the gathered trainable state (rank 0 only); `picked`:
    the state holds the adapter's entries already (`stage_adapters` of every pipeline stage)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = trainable_state if picked else get_peft_model_state_dict(model, state_dict=trainable_state)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    for name, config in model.peft_config.items():  # the active adapter is "default" unless renamed
        target = out if name == "default" else out / name
        config.save_pretrained(str(target))


def merged_state(model: nn.Module, full_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """(state dict of the merged model, that model): the adapters folded into the base by peft's
    `merge_and_unload`, on a CPU copy built from the config and the gathered `full_state` (rank 0 only)."""
    from peft import get_peft_model

    from shardtrain.checkpoint.model_state import model_class

    base = model.get_base_model()
    copy = model_class(base)._from_config(base.config, dtype=next(iter(full_state.values())).dtype)
    copy = get_peft_model(copy, copy_module.deepcopy(model.peft_config[model.active_adapter]))
    missing, unexpected = copy.load_state_dict(full_state, strict=False)
    if unexpected or [k for k in missing if k not in tied_aliases(copy)]:
        raise PeftError(f"could not rebuild the adapted model for merging (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]})")
    merged = copy.merge_and_unload()
    return merged.state_dict(), merged

