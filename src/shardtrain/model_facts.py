"""Facts about a model that every layer asks: which weights are tied, the model under a PEFT wrapper, the label
keys, and the ignored label. One place, so that the wrap policy, tensor parallelism, the loaders, checkpoints and
LoRA agree on them.

    tied_aliases(model)        # {"lm_head.weight": "model.embed_tokens.weight"}: later name -> first name
    base_model(peft_model)     # the transformers model under the adapters
    model_class_from_config(path)  # the transformers class a saved directory's config.json names
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from torch import nn

IGNORE_INDEX = -100  # a label that contributes no loss (Hugging Face's and torch's cross-entropy convention)
# the label columns a dataset may hold (Hugging Face's names); the model receives "labels"
LABEL_COLUMNS = ("labels", "label", "label_ids")
# the batch keys that carry targets, never passed to the model's forward ("shift_labels": context parallelism)
TARGET_KEYS = ("labels", "shift_labels")


def tied_groups(model: nn.Module, *, buffers: bool = False) -> list[list[str]]:
    """The names of each parameter (and buffer, with `buffers`) in registration order, one list per tensor: a list
    of more than one name is a tied weight. Found through the tensor objects, since `state_dict()` detaches."""
    names_of: dict[int, list[str]] = {}
    entries = [*model.named_parameters(remove_duplicate=False),
               *(model.named_buffers(remove_duplicate=False) if buffers else [])]
    for name, tensor in entries:
        names_of.setdefault(id(tensor), []).append(name)
    return list(names_of.values())


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Each later name of a tied parameter -> its first name."""
    return {alias: names[0] for names in tied_groups(model) for alias in names[1:]}


def tied_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters reachable under more than one name (e.g. tied input and output embeddings)."""
    ids: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        ids[id(param)] = ids.get(id(param), 0) + 1
    return {pid for pid, count in ids.items() if count > 1}


# set on the input embedding and output head of a model whose tied embeddings a pipeline split over two stages
TIED_ACROSS_STAGES = "_shardtrain_tied_across_stages"


def tied_embedding_modules(model: nn.Module) -> set[str]:
    """Module names of the input embedding and the output head when they share their weight (also when a pipeline
    keeps them on different stages, their gradients summed), else empty."""
    across = {name for name, module in model.named_modules() if getattr(module, TIED_ACROSS_STAGES, False)}
    if across:
        return across
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    if not callable(get_out) or not callable(get_in):
        return set()
    head, embed = get_out(), get_in()
    weight = getattr(head, "weight", None)
    if weight is None or weight is not getattr(embed, "weight", None):
        return set()
    return {name for name, module in model.named_modules() if module is head or module is embed}


def base_model(model: nn.Module) -> nn.Module:
    """The model under a PEFT wrapper (`get_base_model()`), or the model itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def model_class_from_config(path: Path) -> type:
    """The transformers class named by `path`/config.json's `architectures` (default AutoModelForCausalLM)."""
    config = json.loads((Path(path) / "config.json").read_text())
    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM
