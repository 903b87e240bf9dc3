"""Host memory of loading a pretrained model under FSDP2: each rank reading its slices vs rank 0 reading all.

    .venv/bin/python benchmarks/sharded_load.py --out benchmarks/results/sharded_load.json     # ~3 min, 4 ranks
    .venv/bin/python benchmarks/sharded_load.py --size small --nproc 2 --out /tmp/load.json

Writes a Llama-shaped model once (`--size big`: hidden 2048, 3 layers, vocab 32000, untied: 285M parameters,
1.14 GB in fp32) with `save_pretrained(max_shard_size="200MB")`, then runs one
`python -m torch.distributed.run` launch of this file per read mode, each calling
`shardtrain.load_pretrained(path, cpu_ram_efficient_loading=True)`:

  * `sharded`: every rank builds the model on the meta device, FSDP2 shards it, and each rank reads only the
    rows of its shards from the safetensors files (DCP's `HuggingFaceStorageReader`);
  * `rank0`: rank 0 reads the whole model with `from_pretrained`, the others build on meta and receive a
    broadcast (`set_model_state_dict(broadcast_from_rank0=True)`): the path for non-safetensors sources;
  * `meta_object`: a script's own `from_pretrained(path, device_map="meta")` on every rank (reads nothing), then
    what the Trainer does with such a model object (`meta_source` -> `apply_fsdp` -> `read_from_source`: each
    rank reads its shards from the directory the model names);
  * `every_rank`: a script's plain `from_pretrained(path)` on every rank, then `apply_fsdp` (the model object
    the Trainer warns about: transformers reads every weight on each rank).

Per rank: peak resident set growth during the load (VmHWM reset at the baseline through /proc/self/clear_refs,
so the import-time peak does not hide it) and its resident growth afterwards, next to the bound the issue
sets: 1.3 x (model / ranks + largest tensor). Each rank also checks its local shards against the files'
bytes (`equal_to_files`). Prints JSON, writes --out. The malloc settings are glibc's own
(SHARDTRAIN_CPU_ALLOCATOR=default), so freed buffers go back to the kernel and RSS shows what is held.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {  # hidden, intermediate, layers, vocab, heads, kv heads
    "big": (2048, 5632, 3, 32000, 16, 8),
    "small": (256, 688, 2, 8000, 4, 2),
}
MODES = ("sharded", "rank0", "meta_object", "every_rank")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := current RSS


def write_model(size: str, path: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, vocab, heads, kv = SIZES[size]
    if not (path / "config.json").is_file():
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=kv,
                             tie_word_embeddings=False, max_position_embeddings=256)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path, max_shard_size="200MB")
    from safetensors import safe_open

    sizes = []
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                sl = handle.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                sizes.append(n * 4)
    return {"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
            "files": len(list(path.glob("*.safetensors")))}


def worker(cli: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401  (code, not state, before the baseline)
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from shardtrain import FSDPConfig, destroy_distributed, init_distributed, load_pretrained

    init_distributed()
    rank = dist.get_rank()
    dist.barrier()
    _reset_peak()
    baseline = _status_kib("VmRSS")
    config = FSDPConfig.load({"cpu_ram_efficient_loading": True,
                              "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    if cli.mode in ("sharded", "rank0"):
        model = load_pretrained(cli.path, config, read=cli.mode)
    else:
        from transformers import LlamaForCausalLM

        from shardtrain.parallel.fsdp import apply_fsdp
        from shardtrain.parallel.loading import meta_source, read_from_source

        meta = cli.mode == "meta_object"
        # use_kernels=False: transformers >= 5.25 kernelizes by default, which raises on the meta device
        model = LlamaForCausalLM.from_pretrained(cli.path,
                                                 **({"device_map": "meta", "use_kernels": False} if meta else {}))
        source = meta_source(model) if meta else None
        apply_fsdp(model, config)
        if meta:
            read_from_source(model, *source, torch.device("cpu"))
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters() if isinstance(p, DTensor))
    # this rank's shards equal the files' bytes (reads only this rank's rows again)
    files = {}
    for file in Path(cli.path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    equal = True
    for name, param in model.named_parameters():
        shard = param.to_local() if isinstance(param, DTensor) else param
        if not shard.numel():
            continue
        rows = param.__create_chunk_list__()[0].offsets[0] if isinstance(param, DTensor) else 0
        with safe_open(str(files[name]), framework="pt") as handle:
            expected = handle.get_slice(name)[rows:rows + shard.shape[0]].to(shard.dtype)
        equal = equal and torch.equal(shard, expected)
    record = {"rank": rank, "peak_rss_growth_bytes": (peak - baseline) * 1024,
              "rss_growth_after_bytes": (after - baseline) * 1024, "local_shard_bytes": local_bytes,
              "equal_to_files": bool(equal)}
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if rank == 0:
        Path(cli.out_file).write_text(json.dumps(records))
    destroy_distributed()


def main() -> None:
    import sys

    sys.path.insert(0, str(HERE))
    from bench_common import emit, launch_self

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out-file")
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--path")
    parser.add_argument("--size", choices=sorted(SIZES), default="big")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model-dir", default=os.path.expanduser("~/.cache/shardtrain/bench-load"))
    parser.add_argument("--out")
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    path = Path(cli.model_dir) / cli.size
    facts = write_model(cli.size, path)
    bound = 1.3 * (facts["model_bytes"] / cli.nproc + facts["largest_tensor_bytes"])
    result = {"benchmark": "sharded_load", "size": cli.size, "nproc": cli.nproc, **facts,
              "bound_bytes": int(bound), "modes": {}}
    os.environ["SHARDTRAIN_CPU_ALLOCATOR"] = "default"
    for mode in MODES:
        ranks = launch_self(__file__, cli.nproc, ["--mode", mode, "--path", str(path)], f"{mode} load")
        result["modes"][mode] = {
            "ranks": ranks,
            "max_peak_rss_growth_bytes": max(r["peak_rss_growth_bytes"] for r in ranks),
            "within_bound": all(r["peak_rss_growth_bytes"] <= bound for r in ranks),
            "equal_to_files": all(r["equal_to_files"] for r in ranks),
        }
    emit(result, cli.out)


if __name__ == "__main__":
    main()
