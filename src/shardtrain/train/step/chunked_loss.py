"""Chunked cross entropy: the LM head and the fp32 cross entropy run over a few tokens at a time.

The unchunked loss holds a micro-batch's full logits, their fp32 copy, the log-softmax kept for backward and,
in backward, its gradient: with 128k-152k vocabularies often the step's peak. Here the model runs with its
output embedding (`get_output_embeddings()`, an `nn.Linear`) returning its input, and
`F.linear(chunk, head.weight, head.bias).float()` -> `cross_entropy(reduction="sum")` runs per chunk of tokens
under `torch.utils.checkpoint` (non-reentrant), so backward recomputes one chunk's logits at a time. The
per-token math is the same; only the summation order of the token losses differs (fp32 rounding).

It is used only where it is exact: the head is a plain `nn.Linear` and the model's forward returns the head's
output as `logits` untouched (read from its source: `logits = self.<head>(x)` once, `logits` then only handed
on), and no config key of a known logit post-processing (soft-capping, scaling) is set. `chunking_blocker`
says why not otherwise.

    from shardtrain.train.step.chunked_loss import chunking_blocker, resolve_chunk_size, chunked_cross_entropy
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import textwrap
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtrain.errors import ChunkedLossError
from shardtrain.model_facts import IGNORE_INDEX

AUTO = "auto"
# Config keys with which transformers' models change the logits after the head (Gemma 2/3, Cohere, Granite,
# FalconH1, ...): with any of them set the model is refused even if its forward looked plain.
POST_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                  "output_logit_soft_cap", "logits_soft_cap", "logits_mup_width_multiplier", "lm_head_multiplier")
# "auto": the largest power of two of tokens whose fp32 logits fit this, but at least AUTO_MIN_TOKENS tokens
AUTO_CHUNK_BYTES = 256 * 2**20
AUTO_MIN_TOKENS = 128


def parse_setting(value: Any) -> int | str | None:
    """`TrainingArguments.loss_chunk_size` as given (also from a command line): None / 0 (off), a positive int
    (tokens per chunk) or "auto".

    Raises:
        ChunkedLossError: anything else.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none", "0", "off", "false"):
            return None
        if text == AUTO:
            return AUTO
        if text.isdigit():
            value = int(text)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ChunkedLossError(f"TrainingArguments.loss_chunk_size must be None/0 (off), a positive int (tokens "
                               f"per chunk) or 'auto', got {value!r}")
    return value


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (its forward decides what happens to the logits)."""
    if callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output embedding (`get_output_embeddings()`), or None."""
    get_out = getattr(_unwrap(model), "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    return head if isinstance(head, nn.Module) else None


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _forward_blocker(model: nn.Module, head: nn.Module) -> str | None:
    """Why the model's forward may do more with the head's output than return it as `logits` (None: it does not).

    Allowed: exactly one `logits = self.<head>(x)` (the only call of the head), then `logits` only handed to a
    `...Output...(logits=logits)` constructor or to `self.loss_function` (which runs with labels only; the
    Trainer passes none).
    """
    names = [name for name, child in model.named_children() if child is head]
    if not names:
        return "its output embedding is not a direct attribute of the model"
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(type(model).forward)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return f"the source of {type(model).__name__}.forward cannot be read to check what it does with the logits"
    parents = _parents(tree)
    head_calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                  and n.func.attr in names and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign)
               and any(isinstance(t, ast.Name) and t.id == "logits"
                       for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    if len(head_calls) != 1 or len(assigns) != 1 or assigns[0].value is not head_calls[0] \
            or len(head_calls[0].args) != 1 or head_calls[0].keywords:
        return (f"{type(model).__name__}.forward does more than `logits = self.{names[0]}(hidden_states)` "
                "(the logits are changed after the head, or the head is called differently)")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and node.id == "logits" and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents.get(id(node))
        call = parents.get(id(parent)) if isinstance(parent, ast.keyword) and parent.arg == "logits" else parent
        if isinstance(call, ast.Call) and (_is_output_class(call.func) or (isinstance(call.func, ast.Attribute)
                                                                           and call.func.attr == "loss_function")):
            continue
        return f"{type(model).__name__}.forward uses the logits after the head (line {node.lineno} of its source)"
    return None


def _is_output_class(func: ast.expr) -> bool:
    """`CausalLMOutputWithPast(...)` and the like: transformers' output dataclasses hold the logits as given."""
    return isinstance(func, ast.Name) and "Output" in func.id


def chunking_blocker(model: nn.Module) -> str | None:
    """Why the chunked loss would not compute exactly what the model's logits give; None when it would."""
    base = _unwrap(model)
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return "prompt-learning PEFT adapters change the model's inputs and outputs"
    head = output_head(model)
    if head is None:
        return f"{type(base).__name__} has no output embedding (get_output_embeddings())"
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return f"its output embedding is a {type(head).__name__}, not a plain nn.Linear"
    if _foreign_hooks(head):
        return "its output embedding has forward hooks (they would see the hidden states instead of the logits)"
    if _resharded_after_forward(head):
        return ("its output embedding is an FSDP unit that reshards after forward (e.g. SIZE_BASED_WRAP); the "
                "chunked loss needs its weight gathered until backward, as the output unit keeps it")
    for config in (getattr(base, "config", None), getattr(getattr(base, "config", None), "text_config", None)):
        for key in POST_HEAD_KEYS:
            if config is not None and getattr(config, key, None) is not None:
                return f"its config sets {key} = {getattr(config, key)!r}, which changes the logits after the head"
    return _forward_blocker(base, head)


def _foreign_hooks(module: nn.Module) -> bool:
    """Forward hooks other than FSDP2's own (unshard before, backward hooks after): those may read the logits."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any("torch.distributed.fsdp" not in (getattr(hook, "__module__", None) or "") for hook in hooks)


def _resharded_after_forward(head: nn.Module) -> bool:
    """The head is its own FSDP2 unit (not the root, not the output unit) that frees its gathered weight after
    forward: the chunks' backward would find it sharded."""
    get_state = getattr(head, "_get_fsdp_state", None)
    group = get_state()._fsdp_param_group if callable(get_state) else None
    return bool(group is not None and group.post_forward_mesh_info is not None)


def resolve_chunk_size(setting: int | str | None, model: nn.Module, *, tensor_parallel: bool = False,
                       device_type: str = "cpu") -> int:
    """Tokens per chunk for this model, 0 for the unchunked loss.

    Args:
        setting: `TrainingArguments.loss_chunk_size` (parsed by `parse_setting`).
        model: the model as the Trainer runs it (after FSDP).
        tensor_parallel: the head's weight is a tensor-parallel DTensor (tp > 1): not chunked.
        device_type: "xla" is not chunked (the XLA path traces whole graphs).

    Raises:
        ChunkedLossError: chunking was asked for explicitly (an int) on a model or setup where it is not exact.
    """
    setting = parse_setting(setting)
    if setting is None:
        return 0
    reason = chunking_blocker(model)
    if reason is None and tensor_parallel:
        reason = "tensor parallelism shards the head's weight (tp_size > 1)"
    if reason is None and device_type == "xla":
        reason = "the XLA (TPU) path does not run it"
    if reason is None and getattr(model, "_compiled_call_impl", None) is not None:
        reason = "the whole model is compiled as one graph (torch_compile without FSDP units)"
    if reason is not None:
        if setting == AUTO:
            return 0
        raise ChunkedLossError(f"TrainingArguments.loss_chunk_size = {setting} cannot be exact for "
                               f"{type(_unwrap(model)).__name__}: {reason}; unset it (or use 'auto', which falls "
                               "back to the unchunked loss where chunking is not exact)")
    if setting == AUTO:
        vocab = output_head(model).out_features
        return max(AUTO_MIN_TOKENS, 2 ** int(math.log2(max(AUTO_CHUNK_BYTES // (4 * vocab), 1))))
    return int(setting)


@contextlib.contextmanager
def head_returns_input(head: nn.Module) -> Iterator[None]:
    """The head's forward returns its input for the duration (an instance attribute over the class's forward):
    `nn.Module.__call__` still runs its hooks, so FSDP2 unshards it and registers its backward hooks as usual."""
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor) -> torch.Tensor:
    # exactly the unchunked path's ops on these rows: the head (in the compute dtype), then fp32 cross entropy
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor,
                          chunk_size: int) -> torch.Tensor:
    """Sum over tokens of cross_entropy(head(hidden), targets), `chunk_size` tokens at a time.

    Args:
        hidden: what the head received, (..., hidden_size); its leading dims are those of `targets`.
        head: the output embedding; its `weight` (and `bias`) must be unsharded now (FSDP2 keeps the root and the
            output unit gathered from forward to backward).
        targets: token ids aligned with `hidden`, -100 ignored.
        chunk_size: tokens per chunk (> 0).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ChunkedLossError(f"the head's input has {tuple(hidden.shape[:-1])} tokens but the labels are "
                               f"{tuple(targets.shape)}; unset TrainingArguments.loss_chunk_size for this model")
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    # split (one backward node that concatenates the chunks' gradients), not slicing (a zero-filled full-size
    # gradient per chunk)
    pieces = zip(flat.split(chunk_size), flat_targets.split(chunk_size), strict=True)
    total = None
    for piece, piece_targets in pieces:
        if torch.is_grad_enabled():
            loss = checkpoint(_chunk_loss, piece, head.weight, head.bias, piece_targets, use_reentrant=False)
        else:  # evaluation: nothing is kept, so nothing to recompute
            loss = _chunk_loss(piece, head.weight, head.bias, piece_targets)
        total = loss if total is None else total + loss
    return total
