"""Context-parallel attention against full attention, on 2 ranks (gloo); writes one JSON per rank.

    torchrun --nproc_per_node 2 tests/distributed/workers/cp_attention.py OUT_DIR

1. The bare attention: forward and backward of cp=2 equal SDPA over the whole sequence (causal, key padding,
   sliding window, grouped-query heads), with and without load balancing.
2. Whole models (Llama, Qwen2 with a sliding window), no FSDP: the summed loss and every parameter gradient of
   a padded batch split over cp=2 equal one forward/backward of the full batch; so do those of a packed row
   (three documents, positions restarting), whose documents each get the logits they have alone.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_models import tiny_llama, tiny_qwen2

from shardtrain.parallel.context import ContextParallel, CPShard, cp_attention
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.distributed import destroy_distributed, init_distributed


class _Module(torch.nn.Module):  # what cp_attention reads from the attention module
    is_causal = True


def reference_attention(q, k, v, padding, causal, window):
    length = q.shape[2]
    pos = torch.arange(length)
    allowed = padding[:, None, None, :].clone()
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])[None, None]
    if window:
        allowed = allowed & (pos[None, :] > pos[:, None] - window)[None, None]
    repeat = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                          attn_mask=allowed)


def attention_cases(cp: ContextParallel) -> list[dict]:
    out = []
    for load_balance in (True, False):
        cp.load_balance = load_balance
        for causal, window, recompute in ((True, None, False), (True, 5, False), (False, None, False),
                                          (True, None, True)):
            gen = torch.Generator().manual_seed(7)
            q = torch.randn(2, 4, 16, 8, generator=gen, requires_grad=True)
            k = torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True)
            v = torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True)
            weight = torch.randn(2, 16, 4, 8, generator=gen)
            padding = torch.ones(2, 16, dtype=torch.bool)
            padding[1, 11:] = False  # the second row is padded on the right
            ref = reference_attention(q, k, v, padding, causal, window).transpose(1, 2)
            (ref * weight).sum().backward()
            ref_grads = [t.grad.clone() for t in (q, k, v)]
            mine = cp.indices(16, cp.rank)
            keys = torch.cat([cp.indices(16, r) for r in range(cp.size)])
            shard = CPShard(cp.group, mine, keys, padding[:, keys], 16, recompute=recompute)
            lq, lk, lv = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
            module = _Module()
            module.is_causal = causal
            got, _ = cp_attention(module, lq, lk, lv, None, sliding_window=window, shardtrain_cp=shard)
            (got * weight[:, mine]).sum().backward()
            out.append({
                "load_balance": load_balance, "causal": causal, "window": window, "recompute": recompute,
                "out": (got - ref[:, mine]).abs().max().item(),
                "dq": (lq.grad - ref_grads[0][:, :, mine]).abs().max().item(),
                "dk": (lk.grad - ref_grads[1][:, :, mine]).abs().max().item(),
                "dv": (lv.grad - ref_grads[2][:, :, mine]).abs().max().item(),
                "grad_scale": ref_grads[1].abs().max().item(),
            })
    cp.load_balance = True
    return out


def padded_batch() -> dict:
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, 64, (3, 11), generator=gen)  # 11 tokens: padded to 12 for 2 x cp chunks
    attention = torch.ones_like(input_ids)
    attention[1, 7:] = 0
    attention[2, 4:] = 0
    return {"input_ids": input_ids, "attention_mask": attention,
            "labels": input_ids.masked_fill(attention == 0, -100)}


def packed_batch() -> dict:
    """One row of three documents (5, 4 and 4 tokens; padded to 16 under cp), as DataCollatorWithFlattening
    makes it: positions restart, each document's first label is ignored."""
    from transformers import DataCollatorWithFlattening

    gen = torch.Generator().manual_seed(4)
    docs = [{"input_ids": torch.randint(1, 64, (n,), generator=gen).tolist()} for n in (5, 4, 4)]
    return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)(docs)


def model_cases(cp: ContextParallel) -> list[dict]:
    out = []
    for name, build, batch in (("llama", lambda: tiny_llama(layers=2), padded_batch()),
                               ("qwen2", tiny_qwen2, padded_batch()),
                               ("llama_packed", lambda: tiny_llama(layers=2), packed_batch())):
        ref_model = build()
        ref_model.config._attn_implementation = "sdpa"
        ref_model.config.use_cache = False  # transformers builds the packed mask only without a cache
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = ref_model(**inputs).logits
        shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        ref_loss = F.cross_entropy(logits.reshape(-1, 64), shifted.reshape(-1), ignore_index=-100, reduction="sum")
        ref_loss.backward()
        model = build()
        cp.enable(model)
        local = cp.shard(batch, shift_labels=True)
        local_labels = local.pop("shift_labels")
        local_logits = model(**local).logits
        loss = F.cross_entropy(local_logits.reshape(-1, 64), local_labels.reshape(-1), ignore_index=-100,
                               reduction="sum")
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grad_diff = 0.0
        for p, ref_p in zip(model.parameters(), ref_model.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            grad_diff = max(grad_diff, (grad - ref_p.grad).abs().max().item())
        full_logits = cp.gather_sequence(local_logits.detach(), local["shardtrain_cp"])
        case = {"model": name, "loss": total.item(), "ref_loss": ref_loss.item(), "grad_diff": grad_diff,
                "logits_shape": list(full_logits.shape), "ref_logits_shape": list(logits.shape),
                "logits_diff": (full_logits - logits.detach()).abs().max().item()}
        if "position_ids" in batch:  # each document of the packed row has the logits it has alone
            starts = [i for i, p in enumerate(batch["position_ids"][0].tolist()) if p == 0] + [logits.shape[1]]
            with torch.no_grad():
                case["document_gap"] = max(
                    (full_logits[:, a:b] - ref_model(input_ids=batch["input_ids"][:, a:b]).logits).abs().max().item()
                    for a, b in zip(starts, starts[1:], strict=False))
        out.append(case)
    return out


def refusals(cp: ContextParallel) -> dict[str, str]:
    """Messages of what the gathered-K/V path refuses instead of computing something else."""
    from shardtrain.errors import ContextParallelError

    out = {}
    q = torch.randn(1, 4, 4, 8)
    shard = CPShard(cp.group, cp.indices(8, cp.rank), torch.arange(8), torch.ones(1, 8, dtype=torch.bool), 8)
    try:
        cp_attention(_Module(), q, q[:, :2], q[:, :2], None, s_aux=torch.zeros(4), shardtrain_cp=shard)
    except ContextParallelError as err:
        out["sinks"] = str(err)
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed()
    dims = ParallelDims.resolve(world_size=dist.get_world_size(), cp=2)
    cp = ContextParallel(dims.build("cpu").cp)
    result = {"attention": attention_cases(cp), "models": model_cases(cp), "refusals": refusals(cp)}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main()
