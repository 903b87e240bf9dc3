"""Sharded reading of Hugging Face checkpoints (`cpu_ram_efficient_loading`) against `from_pretrained`.

torchrun --nproc_per_node 2 load_sharded.py OUT.json DIR

Rank 0 writes tiny Llamas with `save_pretrained` into DIR (several safetensors files; tied and untied
embeddings; a bf16 checkpoint; a pickled `.bin` one;
a base model's checkpoint under the head model), every rank loads each with `load_pretrained`, and rank 0
compares the gathered weights and every buffer with `from_pretrained(dtype=float32)` bit for bit. The log of
`shardtrain.parallel.loading` says which path each load took.
"""

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from launch import LogLines
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from shardtrain import FSDPConfig, destroy_distributed, init_distributed, load_pretrained
from shardtrain.parallel.loading import RANK0_READ

CASES = {  # name: (tie_word_embeddings, dtype, safetensors)
    "untied": (False, torch.float32, True),
    "tied": (True, torch.float32, True),
    "bf16": (False, torch.bfloat16, True),
    "pickled": (False, torch.float32, False),
    # a base model's checkpoint (`layers.0...`, no `model.` prefix) under the head model: transformers' renaming
    "base_tied": (True, torch.float32, True),
}


def write(root: Path) -> None:
    for name, (tied, dtype, safe) in CASES.items():
        config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                             max_position_embeddings=64)
        torch.manual_seed(len(name))
        model = (LlamaModel if name.startswith("base") else LlamaForCausalLM)(config).to(dtype)
        if safe:
            model.save_pretrained(root / name, max_shard_size="20KB")
            if name.startswith("base"):  # the head model's class is what load_pretrained and the reference build
                config.architectures = ["LlamaForCausalLM"]
                config.save_pretrained(root / name)
        else:  # transformers 5 writes safetensors only; it still reads a pickled file (weights_only)
            config.save_pretrained(root / name)
            torch.save(model.state_dict(), root / name / "pytorch_model.bin")


def compare(model: torch.nn.Module, path: Path) -> dict:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if dist.get_rank() != 0:
        return {}
    ref = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref_state = ref.state_dict()
    return {"mismatched": [k for k in ref_state if not torch.equal(full[k], ref_state[k])],
            "bad_buffers": [k for k, b in ref.named_buffers() if not torch.equal(buffers[k], b)],
            "buffers": len(buffers), "keys": len(ref_state), "tied": tied,
            "ref_tied": ref.lm_head.weight is ref.model.embed_tokens.weight,
            "files": len(list(path.glob("*.safetensors"))) + len(list(path.glob("*.bin")))}


def main() -> None:
    out, root = sys.argv[1], Path(sys.argv[2])
    init_distributed()
    if dist.get_rank() == 0:
        write(root)
    dist.barrier()
    handler = LogLines()
    logging.getLogger("shardtrain.parallel.loading").addHandler(handler)
    logging.getLogger("shardtrain.parallel.loading").setLevel(logging.INFO)
    config = FSDPConfig.load({"cpu_ram_efficient_loading": True,
                              "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    results = {}
    for name in CASES:
        handler.messages.clear()
        model = load_pretrained(root / name, config)
        results[name] = {**compare(model, root / name), "log": list(handler.messages)}
    handler.messages.clear()
    results["rank0_read"] = {**compare(load_pretrained(root / "untied", config, read=RANK0_READ), root / "untied"),
                             "log": list(handler.messages)}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
