"""`generate` on an FSDP2-sharded tiny Llama (2 ranks) against the unsharded model, one JSON per rank.

    torchrun --nproc_per_node 2 tests/distributed/workers/generate.py OUT_DIR

Rank r generates from prompt r (different lengths). The EOS token is chosen from the unsharded model's greedy
output so that rank 0 reaches it 5 or more tokens before rank 1: without transformers' synced_gpus a finished rank
would stop taking part in FSDP's all-gathers and the other would hang. Cases: greedy with and without KV cache,
sampling with a fixed seed, and a LoRA model (peft) sharded the same way.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import tiny_llama

from shardtrain import FSDPConfig, apply_fsdp, destroy_distributed, init_distributed

PROMPTS = [[5, 9, 14], [7, 3, 22, 41, 8, 19, 2]]
NEW = 16


def generate(model, prompt, eos, **kwargs):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, eos_token_id=eos,
                         pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def pick_eos(model) -> tuple[int, int]:
    """(eos, step): a token rank 0's prompt produces at `step` that rank 1's prompt does not produce before
    `step + 5`."""
    first = generate(model, PROMPTS[0], None, do_sample=False)
    second = generate(model, PROMPTS[1], None, do_sample=False)
    for step in range(1, NEW - 6):
        token = first[step]
        if token not in first[:step] and token not in second[:step + 6]:
            return token, step
    raise AssertionError(f"no EOS candidate in {first} / {second}")


def build(lora: bool):
    model = tiny_llama(layers=2)
    model.generation_config.pad_token_id = 0
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model.eval()


def main() -> None:
    out = Path(sys.argv[1])
    init_distributed()
    rank = dist.get_rank()
    results = []
    for lora in (False, True):
        reference = build(lora)
        eos, eos_step = pick_eos(reference)
        sharded = build(lora)
        apply_fsdp(sharded, FSDPConfig.load({}))
        for name, kwargs in (("greedy", {"do_sample": False}), ("greedy_no_cache", {"do_sample": False,
                                                                                    "use_cache": False}),
                             ("sample", {"do_sample": True, "top_k": 0, "temperature": 1.0})):
            torch.manual_seed(123 + rank)
            expected = generate(reference, PROMPTS[rank], eos, **kwargs)
            torch.manual_seed(123 + rank)
            with torch.no_grad():
                got = generate(sharded, PROMPTS[rank], eos, **kwargs)
            results.append({"lora": lora, "case": name, "eos": eos, "eos_step": eos_step, "expected": expected,
                            "got": got})
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
