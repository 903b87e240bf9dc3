"""The planner's load / save rows against the measured host memory of `sharded_load.py` and `sharded_save.py`.

    .venv/bin/python benchmarks/plan_lifecycle.py --out benchmarks/results/plan_lifecycle.json            # ~30 s
    .venv/bin/python benchmarks/plan_lifecycle.py --measure --out benchmarks/results/plan_lifecycle.json  # + small runs

For each measured benchmark JSON, the planner traces the benchmark's own model (same config, same ranks, same
wrap) and its load / save formulas (`shardtrain.plan.lifecycle`) predict the per-rank peak resident growth the
benchmark measured: rank 0 and the largest of the other ranks, for each mode. The load benchmarks' file layout
(`save_pretrained(max_shard_size="200MB")`) is read from the model directory `sharded_load.py` writes (written
if missing) and kept in the output, so `tests/plan/test_lifecycle.py` can redo the predictions without files.
`--measure` first runs the small variants (2 ranks, ~1 min):
`sharded_load.py --size small --nproc 2` and `sharded_save.py --ranks 2 --layers 2 --hidden 512
--intermediate 1024 --vocab 16000`.

Tolerance: |predicted - measured| <= max(10 % of measured, 16 MiB). The absolute part is the process's own
growth that no tensor accounts for (DCP's planning, first-use allocations): 9-13 MiB on the small runs, where
the tensors are a few tens of MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the measured JSON files
MIB = 2**20
TOLERANCE = 0.10
SLACK = 16 * MIB
# measured JSON -> how to rerun it (the small ones under --measure)
LOADS = {"sharded_load.json": None,
         "sharded_load_small.json": ["sharded_load.py", "--size", "small", "--nproc", "2"]}
SAVES = {"sharded_save.json": None,
         "sharded_save_small.json": ["sharded_save.py", "--ranks", "2", "--layers", "2", "--hidden", "512",
                                     "--intermediate", "1024", "--vocab", "16000"]}


def within(predicted: int, measured: int) -> bool:
    """The stated tolerance: 10 % of the measurement or 16 MiB, whichever is larger."""
    return abs(predicted - measured) <= max(TOLERANCE * measured, SLACK)


def layout(config: Any, ranks: int) -> list:
    """The planner's tensor layout of `config` sharded over `ranks` (one decoder layer per FSDP unit)."""
    from shardtrain.plan import plan

    result = plan(config, world_size=ranks, per_device_batch=1, seq_len=8, target="cpu", what_if=False,
                  estimate_step_time=False, fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                                         "cpu_ram_efficient_loading": True})
    return result.trace.tensors


def load_config(size: str) -> Any:
    sys.path.insert(0, str(HERE))
    from sharded_load import SIZES
    from transformers import LlamaConfig

    hidden, inter, layers, vocab, heads, kv = SIZES[size]
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab,
                       num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=False,
                       max_position_embeddings=256)


def save_config(model: dict) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=model["vocab"], hidden_size=model["hidden"], intermediate_size=model["intermediate"],
                       num_hidden_layers=model["layers"], num_attention_heads=16, num_key_value_heads=4,
                       tie_word_embeddings=False)


def weight_map_of(size: str) -> dict[str, str]:
    """Key -> file of the model `sharded_load.py` measured (written like it writes it, if missing)."""
    sys.path.insert(0, str(HERE))
    from safetensors import safe_open
    from sharded_load import write_model

    path = Path(os.path.expanduser("~/.cache/shardtrain/bench-load")) / size
    write_model(size, path)
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out.update(dict.fromkeys(handle.keys(), file.name))
    return out


def predict_load(tensors: list, weight_map: dict[str, str]) -> dict[str, dict[str, int]]:
    """Predicted peak growth per mode: rank 0 and the other ranks (which hold at most rank 0's shard)."""
    from shardtrain.plan.lifecycle import load_sharded_read

    read = load_sharded_read(tensors, weight_map)
    full = sum(t.full_bytes for t in tensors)
    biggest = max(t.full_bytes for t in tensors)
    return {"sharded": {"rank0": read["host_peak_on_host"], "others": read["host_peak_on_host"]},
            "rank0": {"rank0": full + read["shard"], "others": read["shard"] + biggest}}


def predict_save(tensors: list, ranks: int, total_bytes: int) -> dict[str, dict[str, int]]:
    """Predicted peak growth per mode of `sharded_save.py` (its `sharded_split` splits at model / 4 + 1 %)."""
    from shardtrain.plan.lifecycle import save_model_sharded

    full = sum(t.full_bytes for t in tensors)
    biggest = max(t.full_bytes for t in tensors)
    out = {"gather": {"rank0": full + biggest, "others": 2 * biggest}}
    for mode, max_shard in (("sharded", None), ("sharded_split", int(total_bytes / 4 * 1.01))):
        save = save_model_sharded(tensors, ranks, **({"max_shard_bytes": max_shard} if max_shard else {}))
        out[mode] = {"rank0": max(save["staging"], save["consolidation_rank0"]),
                     "others": max(save["staging"], save["consolidation_others"])}
    return out


def _rows(name: str, predicted: dict, measured: dict) -> list[dict]:
    rows = []
    for mode, pred in predicted.items():
        for who in ("rank0", "others"):
            meas = measured[mode][who]
            rows.append({"benchmark": name, "mode": mode, "ranks": who, "predicted_bytes": pred[who],
                         "measured_bytes": meas, "predicted_mib": round(pred[who] / MIB, 1),
                         "measured_mib": round(meas / MIB, 1), "error": round((pred[who] - meas) / meas, 4),
                         "within_tolerance": within(pred[who], meas)})
    return rows


def measured_load(result: dict) -> dict[str, dict[str, int]]:
    return {mode: {"rank0": v["ranks"][0]["peak_rss_growth_bytes"],
                   "others": max(r["peak_rss_growth_bytes"] for r in v["ranks"][1:])}
            for mode, v in result["modes"].items()}


def measured_save(result: dict) -> dict[str, dict[str, int]]:
    return {mode: {"rank0": int(v["per_rank"][0]["rss_growth_mb"] * MIB),
                   "others": int(max(r["rss_growth_mb"] for r in v["per_rank"][1:]) * MIB)}
            for mode, v in result["modes"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="rerun the small load / save benchmarks first")
    parser.add_argument("--out", type=Path)
    cli = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cli.measure:
        for name, command in {**LOADS, **SAVES}.items():
            if command:
                subprocess.run([sys.executable, str(HERE / command[0]), *command[1:], "--out", str(RESULTS / name)],
                               check=True, env=env, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = {"benchmark": "plan_lifecycle", "tolerance": {"relative": TOLERANCE,
                                                                           "absolute_bytes": SLACK},
                              "weight_maps": {}, "rows": []}
    for name in LOADS:
        measured = json.loads((RESULTS / name).read_text())
        weight_map = weight_map_of(measured["size"])
        result["weight_maps"][name] = weight_map
        tensors = layout(load_config(measured["size"]), measured["nproc"])
        result["rows"] += _rows(name, predict_load(tensors, weight_map), measured_load(measured))
    for name in SAVES:
        measured = json.loads((RESULTS / name).read_text())
        tensors = layout(save_config(measured["model"]), measured["ranks"])
        total = sum(t.full_bytes for t in tensors)
        result["rows"] += _rows(name, predict_save(tensors, measured["ranks"], total), measured_save(measured))
    result["all_within_tolerance"] = all(r["within_tolerance"] for r in result["rows"])
    text = json.dumps(result, indent=1)
    print(json.dumps([{k: r[k] for k in ("benchmark", "mode", "ranks", "predicted_mib", "measured_mib", "error")}
                      for r in result["rows"]], indent=0))
    if cli.out:
        cli.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
