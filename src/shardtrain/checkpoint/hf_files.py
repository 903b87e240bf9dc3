"""Hugging Face's checkpoint files: what `transformers.Trainer` writes into `checkpoint-<step>` besides the model,
read here (and written, by a run that shards nothing), so that checkpoints move between the two trainers.

    optimizer.pt         torch.save(optimizer.state_dict()): parameters by position in the param groups
    scheduler.pt         torch.save(lr_scheduler.state_dict())
    rng_state.pth        {"python", "numpy", "cpu"[, "cuda"]}; rng_state_<rank>.pth on several processes
    trainer_state.json   TrainerState.save_to_json (`TrainerState.load_from_json` reads ours too)
    training_args.bin    torch.save(args), as transformers writes it: never read (a pickle)
    generation_config.json, tokenizer / processor files: beside the model, in every checkpoint and in save_model's
                         directory, as transformers writes them (`write_beside_model`)

Nothing is unpickled but through `torch.load(weights_only=True)`: tensors, containers and numbers, plus NumPy's
array type for the RNG file (transformers' own allowlist, `safe_globals`).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shardtrain.errors import CheckpointError

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TRAINING_ARGS_FILE = "training_args.bin"


def saved_processor(processing_class: Any, data_collator: Any) -> Any:
    """What transformers saves beside the model: the processing class, else the data collator's tokenizer (the
    usual `DataCollatorForLanguageModeling(tokenizer)` script passes no processing_class); None: nothing."""
    if processing_class is not None:
        return processing_class
    return getattr(data_collator, "tokenizer", None)


def write_beside_model(out: Path, model: nn.Module, processor: Any) -> None:
    """generation_config.json (a generative model) and the processor's files (tokenizer.json,
    tokenizer_config.json, the chat template, a feature extractor's config), as transformers' `_save` writes
    them into `save_model`'s directory and every checkpoint, so `Auto*.from_pretrained(dir)` finds them."""
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(out)
    if hasattr(processor, "save_pretrained"):
        processor.save_pretrained(out)


def rng_file(rank: int, world_size: int) -> str:
    """The RNG file a process reads and writes, by Hugging Face's rule (one process: `rng_state.pth`)."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def load_tensors(path: Path) -> Any:
    """`torch.load(path, weights_only=True)` on CPU, its failure one `CheckpointError` naming the file."""
    from transformers.trainer_pt_utils import safe_globals  # NumPy's array type, for RNG states

    try:
        # torch warns about the pickle protocol of a file it is about to refuse: the error below says it all
        with safe_globals(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch's UnpicklingError for anything but tensors; EOFError on a truncated file
        raise CheckpointError(f"could not read {path} with torch.load(weights_only=True): {type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}. The file is damaged, or holds "
                              "objects other than tensors (they are never unpickled); resume from another "
                              "checkpoint") from err


def save_rng(directory: Path, rank: int, world_size: int) -> None:
    """This process's RNG states in Hugging Face's format (what `Trainer._load_rng_state` restores)."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all() if world_size > 1 else torch.cuda.get_rng_state()
    torch.save(states, directory / rng_file(rank, world_size))


def set_rng(saved: dict[str, Any]) -> None:
    """Restore RNG states read from a Hugging Face RNG file."""
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.random.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        cuda = saved["cuda"]
        if isinstance(cuda, list | tuple):
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda)


def optimizer_state_by_name(saved: dict[str, Any], optimizer: torch.optim.Optimizer,
                            names: dict[nn.Parameter, str], source: Path) -> dict[str, Any]:
    """`optimizer.pt`'s state (parameters by position) keyed by parameter name instead, the full state dict that
    `torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(full_state_dict=True)` shards into
    `optimizer`. Positions are matched group by group: Hugging Face's groups (weight decay, then none) are the
    ones `shardtrain.train.step.optim.build_optimizer` builds, in the same parameter order.

    Raises:
        CheckpointError: the groups or a state's shape differ (another model, or another optimizer grouping).
    """
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise CheckpointError(f"{source} is not an optimizer state dict (no 'state' and 'param_groups')")
    ours = optimizer.param_groups
    sizes, our_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in ours]
    if sizes != our_sizes:
        raise CheckpointError(f"{source} has parameter groups of {sizes} parameters, this run's optimizer "
                              f"{our_sizes}: it was written for another model or another grouping (weight decay, "
                              "frozen parameters); resume with the model and arguments that wrote it")
    state: dict[str, Any] = {}
    param_groups = []
    for group, our_group in zip(groups, ours):
        fqns = []
        for position, param in zip(group["params"], our_group["params"]):
            fqn = names[param]
            fqns.append(fqn)
            entry = saved["state"].get(position)
            if entry is None:
                continue
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                    raise CheckpointError(f"{source}: the optimizer's {key!r} of parameter {fqn!r} has shape "
                                          f"{tuple(value.shape)}, the parameter {tuple(param.shape)}; the checkpoint "
                                          "was written for another model")
            state[fqn] = entry
        param_groups.append({**group, "params": fqns})
    return {"state": state, "param_groups": param_groups}
