"""Per-rank memory of `Trainer.save_model`: the sharded path next to the old gather-to-rank-0 path, one launch.

    .venv/bin/python benchmarks/sharded_save.py --out benchmarks/results/sharded_save.json       # ~100 s, 4 ranks
    .venv/bin/python benchmarks/sharded_save.py --layers 2 --hidden 512 --out /tmp/s.json  # quick look

One `python -m torch.distributed.run --nproc_per_node 4` launch of this file (`--worker`, gloo, 1 thread per
rank) builds a Llama-shaped fp32 model (default: hidden 2048, intermediate 2048, 8 layers, 16 heads, 4 kv heads,
vocab 32000, untied: 316 M parameters, 1.26 GB), shards it with the Trainer (FSDP2, one unit per decoder layer)
and calls `save_model` three times into fresh directories:

  * `gather`: the old path (`_gather_on_rank0=True`): `get_model_state_dict(full_state_dict=True,
    cpu_offload=True)` on every rank, rank 0 writes `model.safetensors` with safetensors.
  * `sharded`: the new default: every rank writes its shards (DCP + HuggingFaceStorageWriter), then
    consolidates the output files it owns; one file here (the model is under the 5 GiB split), so rank 0
    assembles it, one tensor at a time.
  * `sharded_split`: the new path with `_max_shard_bytes` = a quarter of the model (+1 %): 5 files at the
    default size (`model-0000k-of-00005`; the embedding and the head are files of their own), spread over the
    4 ranks.

Per rank and mode: `rss_growth_mb` = peak resident set during the call (VmHWM, reset through
/proc/self/clear_refs just before) minus the resident set just before; `shard_mb` = this rank's parameter
bytes; `seconds` = the call's wall time (after a barrier on each side). glibc's mmap threshold is fixed at
1 MiB (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the resident set at once and each mode starts from the
same baseline. `target_mb` = shard + the largest output file (the issue's "its shard plus one file buffer");
`shard_plus_largest_tensor_mb` is the tighter bound the sharded path is designed to (DCP's serialised shard,
then one assembled tensor). Afterwards the three outputs are compared tensor by tensor (`outputs_equal`).
Prints JSON, writes --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = ("gather", "sharded", "sharded_split")
MB = 1024 * 1024


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


def worker(cli: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtrain import Trainer, TrainingArguments
    from shardtrain.parallel.distributed import destroy_distributed

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=cli.vocab, hidden_size=cli.hidden, intermediate_size=cli.intermediate,
                         num_hidden_layers=cli.layers, num_attention_heads=16, num_key_value_heads=4,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    args = TrainingArguments(output_dir=str(cli.work / "run"), fsdp=True, save_strategy="no", report_to="none",
                             disable_tqdm=True, fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    trainer = Trainer(model, args)
    del model
    shard = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())
    libc = ctypes.CDLL("libc.so.6")
    options = {"gather": {"_gather_on_rank0": True}, "sharded": {},
               "sharded_split": {"_max_shard_bytes": int(total / 4 * 1.01)}}
    rows: dict[str, Any] = {}
    for mode in MODES:
        libc.malloc_trim(0)
        dist.barrier()
        before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so VmHWM is this call's peak
        start = time.perf_counter()
        trainer.save_model(str(cli.work / mode), **options[mode])
        dist.barrier()
        seconds = time.perf_counter() - start
        row = {"rss_growth_mb": round((_status("VmHWM") - before) / MB, 1), "rss_before_mb": round(before / MB, 1),
               "seconds": round(seconds, 2)}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, row)
        rows[mode] = every
    every_shard: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_shard, shard)
    if dist.get_rank() == 0:
        (cli.work / "worker.json").write_text(json.dumps({
            "total_mb": round(total / MB, 1), "params": total // 4, "largest_tensor_mb": round(largest / MB, 1),
            "shard_mb": [round(s / MB, 1) for s in every_shard], "modes": rows}))
    destroy_distributed()


def compare(work: Path) -> dict[str, Any]:
    """Whether the three outputs hold the same tensors (read one at a time), and their files."""
    from safetensors import safe_open

    from shardtrain.checkpoint.full import weight_files

    files = {mode: {p.name: p.stat().st_size for p in weight_files(work / mode)} for mode in MODES}
    handles = {mode: {} for mode in MODES}
    for mode in MODES:
        for path in weight_files(work / mode):
            handle = safe_open(str(path), framework="pt")
            for key in handle.keys():
                handles[mode][key] = handle
    keys = set(handles["gather"])
    equal = all(set(handles[mode]) == keys for mode in MODES)
    for key in sorted(keys) if equal else []:
        reference = handles["gather"][key].get_tensor(key)
        equal = equal and all(reference.equal(handles[mode][key].get_tensor(key)) for mode in MODES[1:])
    return {"outputs_equal": equal, "tensors": len(keys), "files": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    work = cli.work or Path(tempfile.mkdtemp(prefix="sharded_save_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "SHARDTRAIN_CPU": "1",
           "MALLOC_MMAP_THRESHOLD_": str(MB)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cli.ranks}", str(Path(__file__)),
           "--worker", "--work", str(work), "--hidden", str(cli.hidden), "--intermediate", str(cli.intermediate),
           "--layers", str(cli.layers), "--vocab", str(cli.vocab)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"worker launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    measured = json.loads((work / "worker.json").read_text())
    result: dict[str, Any] = {"benchmark": "sharded_save", "ranks": cli.ranks,
                              "model": {"hidden": cli.hidden, "intermediate": cli.intermediate,
                                        "layers": cli.layers, "vocab": cli.vocab, "dtype": "float32",
                                        "params": measured["params"], "total_mb": measured["total_mb"],
                                        "largest_tensor_mb": measured["largest_tensor_mb"]},
                              "command": "python benchmarks/sharded_save.py " + " ".join(sys.argv[1:]),
                              **compare(work), "modes": {}}
    for mode in MODES:
        largest_file = max(result["files"][mode].values()) / MB
        per_rank = []
        for rank, row in enumerate(measured["modes"][mode]):
            shard = measured["shard_mb"][rank]
            per_rank.append({**row, "shard_mb": shard, "target_mb": round(shard + largest_file, 1),
                             "shard_plus_largest_tensor_mb": round(shard + measured["largest_tensor_mb"], 1)})
        result["modes"][mode] = {
            "max_rss_growth_mb": max(r["rss_growth_mb"] for r in per_rank),
            "within_target": all(r["rss_growth_mb"] <= r["target_mb"] for r in per_rank),
            "within_shard_plus_largest_tensor": all(r["rss_growth_mb"] <= r["shard_plus_largest_tensor_mb"]
                                                    for r in per_rank),
            "seconds": max(r["seconds"] for r in per_rank), "per_rank": per_rank}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    if cli.work is None:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if cli.out:
        cli.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
