"""`shardtrain.plan.plan` on a tiny Llama: exact per-rank state bytes, what each setting changes, model sources.

    OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1 /work/main/.venv/bin/python -m pytest tests/plan/test_planner.py -q
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtrain.plan import plan

LAYERS = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def tiny_config(**extra) -> LlamaConfig:
    values = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": False, "use_cache": False}
    values.update(extra)
    return LlamaConfig(**values)


def quick(model=None, **kwargs):
    kwargs.setdefault("fsdp_config", LAYERS)
    kwargs.setdefault("per_device_batch", 2)
    kwargs.setdefault("seq_len", 16)
    return plan(model if model is not None else tiny_config(), estimate_step_time=False, what_if=False,
                target="cpu", **kwargs)


def rank0_shard_bytes(model: torch.nn.Module, world: int) -> int:
    """FSDP2 shards dim 0 in chunks of ceil(rows / world): rank 0 holds the first (largest) chunk."""
    total = 0
    for param in model.parameters():
        rows = param.shape[0]
        total += min(math.ceil(rows / world), rows) * (param.numel() // rows) * param.element_size()
    return total


@pytest.mark.parametrize("world", [1, 2, 4])
def test_state_rows_are_the_exact_shards(world):
    result = quick(world_size=world)
    torch.manual_seed(0)
    real = LlamaForCausalLM(tiny_config())
    shard = rank0_shard_bytes(real, world)
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    rows = {r.name: r.bytes for r in result.rows}
    assert rows["parameters (sharded)"] == shard + buffers
    assert rows["gradients (sharded)"] == shard
    # AdamW: exp_avg + exp_avg_sq in fp32, plus one fp32 step scalar per parameter tensor
    assert rows["optimizer state"] == 2 * shard + 4 * len(list(real.parameters()))
    assert result.peak == result.trace.peak_breakdown["Total"]
    assert result.peak > rows["parameters (sharded)"] + rows["gradients (sharded)"] + rows["optimizer state"] / 2


def test_settings_move_the_right_rows():
    base = quick(world_size=2)
    ac = quick(world_size=2, activation_checkpointing=True)
    bf16 = quick(world_size=2, bf16=True)
    no_reshard = quick(world_size=2, reshard_after_forward=False)
    accumulate = quick(world_size=2, gradient_accumulation_steps=4)

    def layer_act(result):
        return max(size for name, size in result.trace.layer_activations if "layers" in name)

    assert layer_act(ac) < layer_act(base) / 3  # with AC a layer keeps little more than its input
    assert ac.peak < base.peak
    units = dict(base.trace.units)
    assert dict(bf16.trace.units)["model.layers.0"] * 2 == units["model.layers.0"]  # gathered in bf16
    assert no_reshard.peak > base.peak  # gathered layers stay until backward
    # between micro-batches FSDP keeps every unit's unsharded gradient (no reduce-scatter until the last)
    full_grads = sum(size for _, size in base.trace.units)  # every unit's gradient, unsharded, fp32
    assert accumulate.trace.peak_breakdown["Unsharded Grad"] == full_grads
    assert accumulate.peak > base.peak
    assert {r.name: r.bytes for r in ac.rows}["optimizer state"] == {r.name: r.bytes for r in base.rows}[
        "optimizer state"]


def test_config_json_model_dir_and_module_agree(tmp_path):
    config = tiny_config()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    # a checkpoint stored in bf16: the Trainer still loads it in fp32 (parallel/loading.py), and so does the plan
    (tmp_path / "config.json").write_text(json.dumps({**saved, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    from_config = quick(world_size=2)
    from_dir = quick(tmp_path, world_size=2)
    from_file = quick(tmp_path / "config.json", world_size=2)
    torch.manual_seed(0)
    from_module = quick(LlamaForCausalLM(config), world_size=2)
    assert from_config.peak == from_dir.peak == from_file.peak == from_module.peak


def test_fit_advice_and_json(tmp_path):
    first = quick(world_size=2)
    small = first.peak - first.peak // 10
    result = plan(tiny_config(), fsdp_config=LAYERS, world_size=2, per_device_batch=2, seq_len=16, target="cpu",
                  device_memory=small, what_if=True, tflops=1.0, link_gbps=1.0)
    fit = result.fit
    assert fit["fits"] is False and fit["peak"] == result.peak and fit["headroom"] < 0
    changes = {o["change"].split(":")[0]: o for o in fit["options"]}
    assert changes["activation_checkpointing"]["peak"] == result.what_if_ac.peak < result.peak
    step = result.step
    assert step["compute_s"] == pytest.approx(step["flops"] / 1e12)
    assert step["flops_rate_source"] == "given (--tflops)"
    assert step["wire_bytes"] > 0 and step["collective_bytes"]["allgather_base"] > 0
    json.dumps(result.to_dict())
    assert "does NOT fit" in result.table()


def test_context_parallel_halves_activations():
    base = quick(world_size=2, seq_len=32)
    cp = quick(world_size=4, cp=2, seq_len=32)
    assert cp.trace.logits * 2 == base.trace.logits  # each cp rank holds half of every sequence


@pytest.mark.parametrize(("bf16", "logit_bytes"), [(False, 4), (True, 2)])
def test_logits_and_loss_buffers(bf16, logit_bytes):
    result = quick(world_size=2, bf16=bf16)
    tokens, vocab = 2 * 16, tiny_config().vocab_size
    assert result.trace.logits == tokens * vocab * logit_bytes  # bf16 compute: bf16 logits
    # the loss upcasts: fp32 log-probs kept for backward (+ the scalar loss and its token count)
    assert tokens * vocab * 4 <= result.trace.loss_buffers <= tokens * vocab * 4 + 16


def test_step_flops_and_collectives():
    config = tiny_config()
    batch, seq, heads, head_dim = 2, 16, config.num_attention_heads, config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    linear = sum(m.weight.numel() for m in LlamaForCausalLM(config).modules() if isinstance(m, torch.nn.Linear))
    bmm = 2 * batch * heads * seq * seq * head_dim  # one q.k^T or scores.v product
    # forward + backward of every linear layer: 6 FLOPs per weight per token; attention: 2 products forward,
    # 5 backward (PyTorch's SDPA formulas), per layer
    expected = 6 * linear * batch * seq + 7 * bmm * config.num_hidden_layers
    results = {g: quick(world_size=2, gradient_accumulation_steps=g) for g in (1, 4)}
    assert results[1].trace.flops == expected
    assert results[4].trace.flops == 4 * expected
    one, four = results[1].trace.collective_bytes, results[4].trace.collective_bytes
    assert four["allgather_base"] == 4 * one["allgather_base"]  # forward and backward of every micro-batch
    assert four["reduce_scatter_base"] == one["reduce_scatter_base"]  # once per step
    units = sum(size for _, size in results[1].trace.units)
    assert one["reduce_scatter_base"] == units  # every gradient, fp32, once


def test_step_time_counts_the_replicas_all_reduce_and_calibrates_on_the_step_gemm():
    """no_shard (2 replicas): the gradient all-reduce is sent over the wire ((r-1)/r x 2 of its bytes); the compute
    rate is calibrated on the step's dominant matmul shape (here the rate is given, the shape still recorded)."""
    replicated = plan(tiny_config(), fsdp_config={**LAYERS, "sharding_strategy": "NO_SHARD"}, world_size=2,
                      per_device_batch=2, seq_len=16, target="cpu", what_if=False, tflops=1.0, link_gbps=1.0)
    step = replicated.step
    assert replicated.trace.fsdp_shard_size == 1
    assert step["wire_bytes"] == step["collective_bytes"]["allreduce"]  # 2 x (2-1)/2
    assert step["comm_s"] == pytest.approx(step["wire_bytes"] / 1e9)
    m, k, n = replicated.trace.gemm
    assert m == 2 * 16 and k * n > 0


def test_measured_compute_rate_names_its_shape_and_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = plan(tiny_config(), fsdp_config=LAYERS, world_size=2, per_device_batch=2, seq_len=16, target="cpu",
                  what_if=False, link_gbps=1.0)
    source = result.step["flops_rate_source"]
    m, k, n = result.trace.gemm
    assert f"fp32 {m}x{k} @ {k}x{n} matmul" in source and "1 thread(s)" in source and result.step["flops_rate"] > 0
    # mixed precision: the rate of the dtype the step multiplies in (a GPU's bf16 rate is many times its fp32)
    bf16 = plan(tiny_config(), fsdp_config=LAYERS, world_size=2, per_device_batch=2, seq_len=16, target="cpu",
                what_if=False, link_gbps=1.0, bf16=True)
    assert bf16.step["flops_rate_source"].startswith("measured here: bf16 ") and bf16.step["flops_rate"] > 0


def test_lora_trains_the_adapters_only():
    """The adapters are added on the meta model as the Trainer adds them: every linear layer but the head gets an
    (r x in) A and (out x r) B; gradients and AdamW state exist for those alone (sharded over 2 ranks)."""
    full = quick(world_size=2)
    lora = quick(world_size=2, lora_rank=4)
    config = tiny_config()
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    # q, k, v, o, gate, up, down: r x (in + out) each
    adapter = 4 * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h)) * layers
    assert lora.trace.state["gradients"] == adapter * 4 // 2  # fp32, half on rank 0
    # exp_avg + exp_avg_sq of the adapters' shards, and AdamW's 4-byte step per adapter tensor (7 x A, B per layer)
    assert lora.trace.state["optimizer_state"] == 2 * lora.trace.state["gradients"] + 4 * 7 * 2 * layers
    assert lora.trace.state["parameters"] > full.trace.state["parameters"]  # the base stays, plus the adapters
    assert lora.peak < full.peak


def test_tensor_parallel_splits_the_layers_activations_and_adds_its_collectives():
    """dp 4 vs dp 2 x tp 2 on 4 ranks: each rank holds 1/4 of the state either way; tp splits every layer's
    heads and MLP (so its activations), gathers the sequence (batch 2 per dp rank) and all-reduces over the 2 tp
    ranks (functional collectives, counted over their own group)."""
    dp = plan(tiny_config(), fsdp_config=LAYERS, world_size=4, per_device_batch=2, seq_len=16, target="cpu",
              what_if=False, tflops=1.0, link_gbps=1.0)
    tp = plan(tiny_config(), fsdp_config=LAYERS, world_size=4, tp=2, per_device_batch=2, seq_len=16, target="cpu",
              what_if=False, tflops=1.0, link_gbps=1.0)
    assert tp.settings["parallel"].startswith("dp_replicate 1 x dp_shard 2 x cp 1 x tp 2")
    assert tp.trace.state["parameters"] == pytest.approx(dp.trace.state["parameters"], rel=0.02)
    layer = dict(dp.trace.layer_activations)["model.layers.0"]
    assert dict(tp.trace.layer_activations)["model.layers.0"] < layer
    assert tp.step["collective_bytes"]["all_reduce"] > 0 and "all_reduce" not in dp.step["collective_bytes"]
    assert tp.step["wire_bytes"] > 0


def tiny_moe(**extra):
    from transformers import Qwen3MoeConfig

    values = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "num_experts": 4, "num_experts_per_tok": 2, "use_cache": False}
    return Qwen3MoeConfig(**{**values, **extra})


def test_experts_grouped_matmuls_and_expert_parallel_exchange():
    """A Qwen3-MoE plans at ep 1 (transformers' grouped-matmul experts) and ep 2 (its all-to-all dispatch, under
    uniform routing). The experts' FLOPs: top-2 instead of top-1 adds one (gate_up + down) expert pass per token,
    forward + 2 in backward. At ep 2 each rank holds 2 whole experts instead of half of 4: the same bytes, the
    experts leave the all-gather, and each layer exchanges every (token, expert) pair twice each way."""
    kwargs = {"fsdp_config": {"transformer_layer_cls_to_wrap": ["Qwen3MoeDecoderLayer"]}, "world_size": 2,
              "per_device_batch": 2, "seq_len": 16}
    ep1, top1, ep2 = quick(tiny_moe(), **kwargs), quick(tiny_moe(num_experts_per_tok=1), **kwargs), \
        quick(tiny_moe(), ep=2, **kwargs)
    tokens, hidden, inter, layers = 2 * 16, 32, 16, 2
    assert ep1.trace.flops - top1.trace.flops == 3 * 2 * tokens * (hidden * 2 * inter + inter * hidden) * layers
    assert ep2.trace.flops == ep1.trace.flops
    assert ep2.settings["parallel"].endswith("ep 2 = 2 ranks")
    assert ep2.trace.state == ep1.trace.state
    experts = layers * 4 * (2 * inter * hidden + hidden * inter) * 4  # fp32 bytes of every expert weight
    gathered = ep1.trace.collective_bytes["allgather_base"] - ep2.trace.collective_bytes["allgather_base"]
    assert gathered == experts * 2  # forward + backward all-gather (reshard after forward)
    pairs = tokens * 2
    assert ep2.trace.collective_bytes["all_to_all_single"] == 4 * layers * pairs * hidden * 4
    assert "all_to_all_single" not in ep1.trace.collective_bytes


def test_a_pipeline_stage_holds_its_layers_and_its_microbatches_in_flight():
    """pp 2 on 2 ranks: each rank holds half the model (as FSDP over 2 does); the stage that peaks is traced with
    the microbatches it holds at once (1F1B: 2 of 4 on stage 0; GPipe: all 4), and the bubble lengthens the step."""
    config = tiny_config(num_hidden_layers=4)
    fsdp = quick(config, world_size=2, per_device_batch=4)
    one_f_one_b = quick(config, world_size=2, per_device_batch=4, pp=2, pp_microbatches=4)
    gpipe = quick(config, world_size=2, per_device_batch=4, pp=2, pp_schedule="GPipe", pp_microbatches=4)
    assert one_f_one_b.settings["parallel"].startswith("pp 2 x dp_replicate 1 x dp_shard 1")
    assert one_f_one_b.settings["pipeline"] == {"schedule": "1F1B", "microbatches": 4, "stage_traced": 0,
                                               "microbatches_in_flight": 2, "bubble": 0.2}
    state = sum(fsdp.trace.state.values())
    assert abs(sum(one_f_one_b.trace.state.values()) - state) < 0.2 * state  # half the model each, either way
    activations = {name: sum(v for k, v in p.trace.peak_breakdown.items() if k in ("Activation", "Temp"))
                   for name, p in (("1F1B", one_f_one_b), ("GPipe", gpipe), ("fsdp", fsdp))}
    assert activations["1F1B"] < activations["GPipe"] < activations["fsdp"]  # fewer layers, fewer in flight
    timed = plan(config, world_size=2, per_device_batch=4, seq_len=16, pp=2, pp_microbatches=4, target="cpu",
                 what_if=False, tflops=1.0, link_gbps=1.0, fsdp_config=LAYERS)
    step = timed.step
    assert step["pipeline_bubble"] == 0.2
    assert step["step_s_no_overlap"] == pytest.approx((step["compute_s"] + step["comm_s"]) / 0.8)
    # two stages per rank: the rank traced holds both; Interleaved 1F1B's fill (p - 1) / (2m + p - 1), m = 4 (the
    # default: the pipeline's stages)
    interleaved = quick(config, world_size=2, per_device_batch=4, pp=2, pp_schedule="Interleaved1F1B")
    assert interleaved.settings["pipeline"]["bubble"] == pytest.approx(1 / (2 * 4 + 1))


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (3, 2)])
def test_fill_drain_schedules_played_from_their_tables_idle_for_the_bubble(stages, microbatches):
    """GPipe's and 1F1B's tables (torch builds none for one stage per rank), played with a backward twice a
    forward, leave every rank idle (p - 1) / (m + p - 1) of the step; stages of unequal times idle for the slow
    one; a table whose action waits on one that never comes is refused, naming the rank."""
    from shardtrain.errors import PlanError
    from shardtrain.plan.pipeline_estimate import bubble_fraction, fill_drain_table, idle_shares

    p, m = stages, microbatches
    gpipe, one_f_one_b = (fill_drain_table(name, stages=p, microbatches=m) for name in ("GPipe", "1F1B"))
    assert gpipe[p - 1] == [f"{p - 1}F{i}" for i in range(m)] + [f"{p - 1}B{i}" for i in range(m)]
    if (p, m) == (2, 4):  # 1F1B: p - rank forwards, then a backward and a forward in turn
        assert one_f_one_b == {0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
                               1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]}
    expected = (p - 1) / (m + p - 1)
    for table, name in ((gpipe, "GPipe"), (one_f_one_b, "1F1B")):
        shares = idle_shares(table, stages=p)
        assert shares == pytest.approx(dict.fromkeys(range(p), expected))
        assert bubble_fraction(name, stages=p, microbatches=m) == pytest.approx(expected)
    # a last stage twice as slow sets the pace: 1F1B over 2 ranks, 4 microbatches: the first stage's forward, then
    # 4 of the last stage's (2 + 4), then the first stage's backward: a step of 1 + 24 + 2
    slow = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 2.0, (1, "B"): 4.0}
    if (p, m) == (2, 4):
        assert idle_shares(one_f_one_b, stages=2, durations=slow) == pytest.approx({0: 1 - 12 / 27, 1: 1 - 24 / 27})
    with pytest.raises(PlanError, match=r"ranks \[0, 1\] wait at 0B0 \(rank 0\), 1F0 \(rank 1\)"):
        idle_shares({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]}, stages=2)  # rank 0's backward before its forward
