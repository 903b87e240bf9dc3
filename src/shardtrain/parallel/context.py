"""Context parallelism: each sequence is split over the `cp` ranks; attention gathers keys and values.

    cp = ContextParallel(meshes.cp)                  # enables the attention on the model once
    cp.enable(model)
    local = cp.shard(batch, pad_token_id=0)          # before the forward: shifted labels, positions, mask data
    logits = cp.gather_sequence(local_logits, local) # full length, original order (predict / metrics)

Layout: the (padded) sequence is cut into 2*cp chunks; rank r holds chunks r and 2*cp-1-r (head-tail load
balancing), so every rank has the same share of causal attention work. A length that is not a multiple of 2*cp
is padded with masked keys and ignored labels. Labels are shifted and positions made *before* the split, so
the loss of a rank's tokens is exactly their share of the cp=1 loss.

Attention (`cp_attention`, registered with transformers' `AttentionInterface` as "shardtrain_cp") all-gathers K
and V over `cp` with an autograd-aware collective, so dK/dV are reduce-scattered back to their owners, builds
the mask from the *global* positions of queries and keys (causal, key padding, sliding window; packed rows: each
document apart, found where `position_ids` restart) and calls SDPA.
It runs on every device; PyTorch's own `context_parallel` cannot run causal attention on CPU (pytorch#147793)
and does not take a padding mask. transformers hands a custom attention function `attention_mask=None` unless a
mask function is registered, so under CP the padding travels in the `CPShard` passed as a forward argument.
Outside CP (no `CPShard` argument, e.g. `generate`) the function is SDPA with transformers' own mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from shardtrain.errors import ContextParallelError
from shardtrain.model_facts import IGNORE_INDEX, base_model

ATTENTION_NAME = "shardtrain_cp"  # the name in transformers' AttentionInterface / AttentionMaskInterface
SHARD_KWARG = "shardtrain_cp"  # the forward argument that carries a rank's CPShard down to the attention
_SEQUENCE_KEYS = ("input_ids", "token_type_ids", "position_ids", "labels", "shift_labels", "attention_mask")

_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k")


@dataclass(eq=False)
class CPShard:
    """What one rank's attention needs to attend over the whole sequence.

    `query_index`: sequence positions of this rank's tokens; `key_index`: the position of each key after the
    all-gather (ranks in order); `key_padding`: (batch, keys) True for real tokens, in gathered order.
    """

    group: dist.ProcessGroup
    query_index: torch.Tensor
    key_index: torch.Tensor
    key_padding: torch.Tensor
    length: int  # the original (unpadded) sequence length
    recompute: bool = False
    # packed rows: (batch, keys) document number of each key in gathered order (None: one document per row)
    key_document: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def local_tokens(self) -> torch.Tensor:
        """Real (non-padding) tokens this rank holds."""
        rank = dist.get_rank(self.group)
        n = self.query_index.numel()
        return self.key_padding[:, rank * n:(rank + 1) * n].sum()

    def mask(self, causal: bool, sliding_window: int | None) -> torch.Tensor:
        """(batch, 1, queries, keys) bool: True where a query may attend to a key."""
        key = (causal, sliding_window)
        if key not in self._masks:
            allowed = self.key_padding[:, None, None, :]
            q, k = self.query_index[:, None], self.key_index[None, :]
            if causal:
                allowed = allowed & (k <= q)[None, None]
            if sliding_window is not None:
                allowed = allowed & (k > q - sliding_window)[None, None]  # transformers' sliding_window_overlay
            if self.key_document is not None:  # a packed row: a document's tokens see only their own document
                rank = dist.get_rank(self.group)
                n = self.query_index.numel()
                query_document = self.key_document[:, rank * n:(rank + 1) * n]
                allowed = allowed & (query_document[:, None, :, None] == self.key_document[:, None, None, :])
            self._masks[key] = allowed
        return self._masks[key]


def _gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                        dropout: float, scale: float | None, group: dist.ProcessGroup) -> torch.Tensor:
    key = _all_gather(key.contiguous(), 2, group)
    value = _all_gather(value.contiguous(), 2, group)
    # grouped-query attention: SDPA serves several query heads per K/V head itself (no repeated copies to keep)
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, **gqa)


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (`AttentionInterface`): gathered-K/V attention under CP, SDPA otherwise.

    Shapes as transformers': query (batch, heads, local queries, dim), key/value (batch, kv heads, local keys,
    dim); returns (batch, local queries, heads, dim).
    """
    shard: CPShard | None = kwargs.pop(SHARD_KWARG, None)
    if shard is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    for name in _UNSUPPORTED_KWARGS:  # attention features the gathered-K/V path does not implement
        if kwargs.get(name) is not None:
            raise ContextParallelError(f"{type(module).__name__} passes {name!r} to its attention (e.g. logit "
                                       "softcapping, attention sinks, position bias or packed sequences), which "
                                       "context parallelism does not implement; set cp_size to 1 for this model")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = shard.mask(bool(causal), kwargs.get("sliding_window"))
    dropout = dropout if module.training else 0.0
    if shard.recompute:  # keep only the local Q/K/V for backward; gather K/V again there (less memory)
        out = checkpoint(_gathered_attention, query, key, value, mask, dropout, scaling, shard.group,
                         use_reentrant=False)
    else:
        out = _gathered_attention(query, key, value, mask, dropout, scaling, shard.group)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register `cp_attention` (and SDPA's mask for calls outside CP) under ATTENTION_NAME; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, cp_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class ContextParallel:
    """Splits batches over a `cp` mesh and routes a model's attention through `cp_attention`.

    Args:
        mesh: the 1-D `cp` mesh (from `ParallelDims.build(...).cp`).
        load_balance: head-tail chunks (default); False: contiguous blocks (rank r holds block r).
        recompute: gather K/V again in backward (and recompute the local attention) instead of keeping the
            gathered copies and SDPA's intermediates: less memory, one more all-gather per layer (the default;
            `TrainingArguments(cp_regather_kv=False)` keeps them).
    """

    def __init__(self, mesh: DeviceMesh, *, load_balance: bool = True, recompute: bool = True) -> None:
        self.mesh, self.size, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group()
        self.load_balance, self.recompute = load_balance, recompute

    def enable(self, model: nn.Module) -> None:
        """Route `model`'s attention through `cp_attention`.

        Raises:
            ContextParallelError: the model does not call attention through transformers' interface.
        """
        model = base_model(model)  # a PEFT model: its base model's attention
        config = getattr(model, "config", None)
        if not getattr(type(model), "_supports_attention_backend", False) or config is None:
            raise ContextParallelError(
                f"context parallelism (cp_size {self.size}) needs a model whose attention goes through "
                f"transformers' AttentionInterface; {type(model).__name__} does not (no _supports_attention_backend)"
                "; use a transformers model such as Llama, Qwen2 or Mistral, or set cp_size to 1")
        register_attention()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTENTION_NAME)
        else:
            config._attn_implementation = ATTENTION_NAME

    def indices(self, length: int, rank: int) -> torch.Tensor:
        """Sequence positions rank `rank` holds of a padded sequence of `length` (a multiple of 2*size)."""
        if self.load_balance:
            chunk = length // (2 * self.size)
            first, second = rank, 2 * self.size - 1 - rank
            return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                              torch.arange(second * chunk, (second + 1) * chunk)])
        block = length // self.size
        return torch.arange(rank * block, (rank + 1) * block)

    def shard(self, batch: dict[str, torch.Tensor], *, shift_labels: bool, pad_token_id: int = 0) -> dict[str, Any]:
        """This rank's part of `batch` (every rank of the cp group passes the same full batch).

        Labels are shifted first when `shift_labels` (causal LMs) and returned as `shift_labels`, so the loss
        must not shift them again; `position_ids` are the global positions; the `SHARD_KWARG` entry carries the
        key padding and positions to the attention.
        """
        input_ids = batch["input_ids"]
        rows, length = input_ids.shape
        padded = math.ceil(length / (2 * self.size)) * (2 * self.size)
        extra = padded - length
        device = input_ids.device
        attention = batch.get("attention_mask")
        attention = torch.ones_like(input_ids) if attention is None else attention
        full: dict[str, torch.Tensor] = {}
        positions = batch.get("position_ids")
        documents = None
        if positions is None:
            positions = torch.arange(length, device=device).expand(rows, length)
        elif (positions.diff(dim=-1) != 1).any():
            # packed documents (DataCollatorWithFlattening, TRL's packing): a new one wherever the positions do
            # not count on, as transformers' find_packed_sequence_indices; padding joins the last document, so no
            # query row is left without a key
            documents = (positions.diff(dim=-1, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
            documents = torch.cat([documents, documents[:, -1:].expand(rows, extra)], dim=1)
        full["position_ids"] = torch.cat([positions, torch.arange(length, padded, device=device)
                                          .expand(rows, extra).to(positions.dtype)], dim=1)
        full["input_ids"] = F.pad(input_ids, (0, extra), value=pad_token_id)
        if "token_type_ids" in batch:
            full["token_type_ids"] = F.pad(batch["token_type_ids"], (0, extra))
        labels = batch.get("labels")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ContextParallelError(f"context parallelism needs per-token labels shaped like input_ids "
                                           f"{tuple(input_ids.shape)}, got {tuple(labels.shape)}")
            if shift_labels:
                labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            full["shift_labels"] = F.pad(labels, (0, extra), value=IGNORE_INDEX)
        key_padding = F.pad(attention, (0, extra)).bool()
        mine = self.indices(padded, self.rank).to(device)
        key_index = torch.cat([self.indices(padded, r) for r in range(self.size)]).to(device)
        local: dict[str, Any] = {k: v[:, mine] for k, v in full.items()}
        for key, value in batch.items():  # anything else (e.g. per-sample fields) passes through
            if key not in _SEQUENCE_KEYS:
                local[key] = value
        local[SHARD_KWARG] = CPShard(self.group, mine, key_index, key_padding[:, key_index], length,
                                     recompute=self.recompute,
                                     key_document=None if documents is None else documents[:, key_index])
        return local

    def gather_sequence(self, local: torch.Tensor, shard: CPShard) -> torch.Tensor:
        """(batch, local tokens, ...) per rank -> (batch, original length, ...) in sequence order, on every rank."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        gathered = torch.cat(parts, dim=1)
        out = torch.empty_like(gathered)
        out[:, shard.key_index] = gathered
        return out[:, :shard.length]
