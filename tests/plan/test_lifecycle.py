"""The plan's load / step / save rows: the formulas on known layouts, big world sizes, and the measured benchmarks.

    OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1 /work/main/.venv/bin/python -m pytest tests/plan/test_lifecycle.py -q

The 64- and 512-rank plans use the widths of Llama-3-70B and Qwen3-235B-A22B with 2 layers (the full depth is in
`benchmarks/plan_scale.py` and docs/planning.md: minutes per plan on this machine).
"""

from __future__ import annotations

import json
import math

import pytest
from launch import REPO, benchmark_module
from transformers import LlamaConfig, Qwen3MoeConfig

from shardtrain.plan import plan
from shardtrain.plan.lifecycle import TensorLayout, load_sharded_read, save_model_sharded

MIB = 2**20


def tiny(**extra) -> LlamaConfig:
    values = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": False, "use_cache": False}
    return LlamaConfig(**{**values, **extra})


def quick(config, world: int, **kwargs):
    fsdp = {"transformer_layer_cls_to_wrap": [kwargs.pop("layer", "LlamaDecoderLayer")], **kwargs.pop("fsdp", {})}
    kwargs.setdefault("target", "cpu")
    return plan(config, world_size=world, per_device_batch=1, seq_len=16, estimate_step_time=False, what_if=False,
                fsdp_config=fsdp, **kwargs)


def rows_of(result) -> dict:
    return {r.name: r for r in result.lifecycle}


def test_layout_is_rank0s_fsdp_chunk_of_each_saved_tensor():
    result = quick(tiny(), 4)
    tensors = result.trace.tensors
    assert [t.name for t in tensors][:2] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert tensors[-1].name == "lm_head.weight"
    for t in tensors:
        assert t.local_bytes * 4 == t.full_bytes and t.pieces == 4  # every dim 0 here divides by 4
    assert sum(t.local_bytes for t in tensors) + 4 * 16 // 2 == result.trace.state["parameters"]  # + rotary buffer


def test_sharded_read_is_the_shard_plus_the_mapped_pages_of_one_file():
    layout = [TensorLayout("a", 400, 100, 4), TensorLayout("b", 800, 200, 4), TensorLayout("c", 40, 10, 4)]
    one_file = load_sharded_read(layout, {"a": "f1", "b": "f1", "c": "f1"})
    assert one_file == {"shard": 310, "mapped_file_pages": 310, "host_peak_on_host": 620}
    # files read in state-dict order of their first key: f2 (a, c) then f1 (b); the peak at the end of f1
    two = load_sharded_read(layout, {"a": "f2", "b": "f1", "c": "f2"})
    assert two == {"shard": 310, "mapped_file_pages": 200, "host_peak_on_host": 310 + 200}


def test_save_staging_and_consolidation_terms():
    gib = 2**30
    layout = [TensorLayout("embed", gib, gib // 4, 4), TensorLayout("norm", 4096, 1024, 4),
              TensorLayout("head", gib, gib // 4, 4)]
    save = save_model_sharded(layout, 4)
    # one output file (under 5 GiB): staging groups of <= max(256 MiB, total * 4 / 512) -> each tensor alone
    assert save["files"] == 1
    assert save["staging"] == 2 * (gib // 4)
    # rank 0 assembles every tensor: the head's buffer (1 GiB) is allocated while the norm and its last piece live;
    # the embedding: its buffer + two pieces read back to back
    assert save["consolidation_rank0"] == gib + 2 * (gib // 4)
    assert save["consolidation_others"] == 0
    split = save_model_sharded(layout, 4, max_shard_bytes=gib + 4096)  # 2 files: embed + norm | head
    assert split["files"] == 2
    assert split["consolidation_rank0"] == split["consolidation_others"] == gib + 2 * (gib // 4)  # file 2: rank 1


def test_rows_follow_the_fsdp_config_and_the_target():
    cpu = quick(tiny(), 2, fsdp={"cpu_ram_efficient_loading": True, "state_dict_type": "SHARDED_STATE_DICT"})
    rows = rows_of(cpu)
    assert {n for n, r in rows.items() if r.selected} == {"load: sharded read", "step (predicted peak)",
                                                          "save_model (sharded export)",
                                                          "checkpoint: SHARDED_STATE_DICT"}
    assert all(r.rank0_device == r.other_device == 0 for r in rows.values())  # one memory on the CPU target
    full = sum(t.full_bytes for t in cpu.trace.tensors)
    biggest = max(t.full_bytes for t in cpu.trace.tensors)
    shard = rows["load: sharded read"].parts["shard"]
    assert rows["load: rank-0 read + broadcast"].rank0_host == full + shard
    assert rows["load: rank-0 read + broadcast"].other_host == shard + biggest
    assert rows["step (predicted peak)"].rank0_host == cpu.peak
    gpu = rows_of(quick(tiny(), 2, target="cuda"))
    assert gpu["load: every rank reads all"].selected
    assert gpu["load: sharded read"].rank0_device == shard  # the shard on the device, the file's pages on the host
    assert gpu["load: sharded read"].rank0_host == gpu["load: sharded read"].parts["mapped_file_pages"]
    # FULL_STATE_DICT checkpoints write the model files as save_model does: no rank holds the model whole
    assert gpu["checkpoint: FULL_STATE_DICT"].selected
    checkpoint, export = gpu["checkpoint: FULL_STATE_DICT"], gpu["save_model (sharded export)"]
    assert (checkpoint.rank0_host, checkpoint.other_host) == (export.rank0_host, export.other_host)
    assert "full_model" not in checkpoint.parts and checkpoint.parts["staging"] == export.parts["staging"]
    table = quick(tiny(), 2).table()
    assert "*load: every rank reads all" in table and "*checkpoint: FULL_STATE_DICT" in table
    assert {"phase", "rank0", "other_ranks", "parts_bytes"} <= set(quick(tiny(), 2).to_dict()["load_step_save"][0])


def _chunk(rows: int, world: int) -> int:
    return min(math.ceil(rows / world), rows)


@pytest.mark.parametrize("world", [64, 512])
def test_llama3_70b_widths_at_scale(world):
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=2, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, use_cache=False)
    result = quick(config, world, target="cuda", bf16=True, fsdp={"cpu_ram_efficient_loading": True})
    tensors = {t.name: t for t in result.trace.tensors}
    embed = tensors["model.embed_tokens.weight"]
    assert embed.full_bytes == 128256 * 8192 * 4 and embed.local_bytes == _chunk(128256, world) * 8192 * 4
    rows = rows_of(result)
    full = sum(t.full_bytes for t in tensors.values())
    read = rows["load: sharded read"]
    # no rank holds the model: the shard on the device, at most one file's share of pages on the host
    assert read.rank0_device == sum(t.local_bytes for t in tensors.values()) < full / world * 1.01
    assert read.rank0_host <= 5 * 2**30 / world * 1.01
    assert rows["load: rank-0 read + broadcast"].rank0_device >= full
    save = rows["save_model (sharded export)"]
    # rank 0 assembles file 1 (the embedding first): the next tensor's buffer (q_proj) is allocated while the
    # embedding's buffer and its last piece are still referenced: the most it holds, on the host
    q_proj = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert save.rank0_host == embed.full_bytes + embed.local_bytes + q_proj.full_bytes
    assert save.rank0_device == rows["checkpoint: SHARDED_STATE_DICT"].rank0_device  # the training state stays


@pytest.mark.parametrize("world", [64, 512])
def test_qwen3_235b_a22b_widths_at_scale(world):
    config = Qwen3MoeConfig(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=2,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                            num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False, use_cache=False)
    result = quick(config, world, ep=8, target="cuda", bf16=True, layer="Qwen3MoeDecoderLayer",
                   fsdp={"cpu_ram_efficient_loading": True})
    experts = [t for t in result.trace.tensors if ".experts." in t.name]
    # 128 experts over ep 8 x efsdp world / 8: at 64 ranks FSDP shards the expert dim (2 experts each); at 512 an
    # ep rank's 16 experts are fewer than its 64 efsdp ranks, so FSDP shards dim 1 and every rank holds 1 / 512
    pieces = world
    assert experts and all(t.pieces == pieces and t.local_bytes * pieces == t.full_bytes for t in experts)
    full = sum(t.full_bytes for t in result.trace.tensors)
    read = rows_of(result)["load: sharded read"]
    assert read.rank0_device < full / pieces * 1.05


def test_load_and_save_rows_match_the_measured_benchmarks():
    """The formulas redone on the benchmarks' own models and files, against their measured RSS growth."""
    bench = benchmark_module("plan_lifecycle")
    stored = json.loads((REPO / "benchmarks" / "results" / "plan_lifecycle.json").read_text())
    predicted = {}
    for name in bench.LOADS:
        measured = json.loads((REPO / "benchmarks" / "results" / name).read_text())
        tensors = bench.layout(bench.load_config(measured["size"]), measured["nproc"])
        predicted[name] = bench.predict_load(tensors, stored["weight_maps"][name]), bench.measured_load(measured)
    for name in bench.SAVES:
        measured = json.loads((REPO / "benchmarks" / "results" / name).read_text())
        tensors = bench.layout(bench.save_config(measured["model"]), measured["ranks"])
        total = sum(t.full_bytes for t in tensors)
        predicted[name] = bench.predict_save(tensors, measured["ranks"], total), bench.measured_save(measured)
    checked = 0
    for row in stored["rows"]:
        pred, meas = predicted[row["benchmark"]]
        assert pred[row["mode"]][row["ranks"]] == row["predicted_bytes"], row
        measured_bytes = meas[row["mode"]][row["ranks"]]
        assert bench.within(row["predicted_bytes"], measured_bytes), row
        if measured_bytes > 256 * MIB:  # the big runs, where fixed process overhead is small: within 10 %
            assert abs(row["predicted_bytes"] - measured_bytes) <= 0.10 * measured_bytes, row
        checked += 1
    assert checked == 20
