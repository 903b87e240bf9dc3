"""`plan.auto_layout`: the choice among candidate layouts, the `fsdp_config` keys that ask for it, and the traced
candidates of a tiny Llama (the 2-rank run: tests/distributed/test_auto_layout.py)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_llama

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import FSDPConfigError
from shardtrain.plan.auto_layout import Candidate, Rates, Request, choose, request_for, trace_candidates


def _candidate(sharding: str, ac: str, peak: int, flops: float, wire: float) -> Candidate:
    return Candidate(sharding=sharding, ac=ac, loss_chunk=0, peak=peak, flops=flops, wire_bytes=wire)


CANDIDATES = [_candidate("no_shard", "none", 900, 100, 10), _candidate("shard_grad_op", "none", 700, 100, 10),
              _candidate("full_shard", "none", 600, 100, 15), _candidate("full_shard", "full", 400, 133, 15)]


@pytest.mark.parametrize("budget,expected", [(1000, 1), (650, 2), (500, 3)])
def test_choose_fastest_that_fits(budget, expected):
    # rates 1 flop/s and 1 byte/s: steps 110, 110, 115, 148; a tie (no_shard, shard_grad_op) goes to the smaller peak
    assert choose(CANDIDATES, budget, Rates(1.0, 1.0)) == expected


def test_choose_none_fits_names_the_smallest_and_the_fix():
    with pytest.raises(FSDPConfigError, match=r"no layout fits 300 B per rank \(the smallest, full_shard, AC full, "
                                              r"loss chunk off, needs 400 B\); raise max_memory_per_rank"):
        choose(CANDIDATES, 300, Rates(1.0, 1.0))


def test_candidate_apply():
    config = FSDPConfig.load({"reshard_after_forward": 2})
    no_shard = _candidate("no_shard", "selective", 0, 0, 0).apply(config)
    assert (no_shard.replicate_only, no_shard.reshard_after_forward, no_shard.ac_mode) == (True, False, "selective")
    kept = _candidate("full_shard", "full", 0, 0, 0).apply(config, sharding=False)  # the user's sharding stays
    assert (kept.reshard_after_forward, kept.ac_mode) == (2, "full")


def _spec(raw: dict, sizes: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(fsdp=FSDPConfig.load(raw), sizes=sizes or {}, world_size=2, mixed_precision="no")


def _args(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                              "gradient_checkpointing": False, "loss_chunk_size": None, **changes})


def test_request_leaves_the_users_keys():
    data = [{"input_ids": [1] * n} for n in (5, 9, 7)]
    free = request_for(_spec({"layout": "auto"}), _args(), data, "cpu")
    assert (free.choose_sharding, free.choose_ac, free.choose_loss_chunk, free.seq_len) == (True, True, True, 9)
    fixed = request_for(_spec({"layout": "auto", "reshard_after_forward": False, "activation_checkpointing": False}),
                        _args(loss_chunk_size=64), data, "cpu")
    assert (fixed.choose_sharding, fixed.choose_ac, fixed.choose_loss_chunk) == (False, False, False)
    # the whole model as one unit: offered on CPU while the wrap policy is the planner's to choose
    assert free.choose_units and not request_for(_spec({"layout": "auto"}), _args(), data, "cuda").choose_units
    wrapped = request_for(_spec({"layout": "auto", "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}), _args(), data, "cpu")
    assert not wrapped.choose_units
    assert not request_for(_spec({"layout": "auto"}, {"tp": 2}), _args(), data, "cpu").choose_sharding


@pytest.mark.parametrize(("precision", "dtype"), [("no", torch.float32), ("bf16", torch.bfloat16),
                                                  ("fp16", torch.float16)])
def test_request_times_matmuls_in_the_runs_compute_dtype(precision, dtype):
    """As `plan` does (`step_time.COMPUTE_DTYPES`): an fp16 run's rate is an fp16 matmul's, not fp32's."""
    spec = _spec({"layout": "auto"})
    spec.mixed_precision = precision
    request = request_for(spec, _args(), [{"input_ids": [1] * 4}], "cpu")
    assert (request.mixed_precision, request.compute_dtype) == (precision, dtype)


def test_request_needs_input_ids():
    with pytest.raises(FSDPConfigError, match="reads the sequence length from the train dataset's 'input_ids'"):
        request_for(_spec({"layout": "auto"}), _args(), [{"pixel_values": [0.0]}], "cpu")


def test_traced_candidates_of_a_tiny_llama():
    request = Request(world_size=2, sizes={}, per_device_batch=2, seq_len=16, gradient_accumulation_steps=1,
                      mixed_precision="no", target="cpu", choose_sharding=True, choose_ac=False, choose_loss_chunk=True)
    config = FSDPConfig.load({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "layout": "auto"})
    candidates, gemm = trace_candidates(tiny_llama(), config, request)
    by = {c.sharding: c for c in candidates}
    assert sorted(by) == ["full_shard", "no_shard", "shard_grad_op"] and len(candidates) == 3
    assert gemm is not None and len({c.flops for c in candidates}) == 1  # sharding does not change the FLOPs
    # plain data parallel all-reduces what shard_grad_op all-gathers once and reduce-scatters; full_shard gathers
    # again in backward
    assert by["no_shard"].wire_bytes == pytest.approx(by["shard_grad_op"].wire_bytes, rel=0.01)
    assert by["full_shard"].wire_bytes > by["shard_grad_op"].wire_bytes
    assert by["no_shard"].peak > by["shard_grad_op"].peak >= by["full_shard"].peak
    assert dataclasses.replace(by["no_shard"]).apply(config).replicate_only


def test_a_pipeline_is_offered_to_plain_data_parallel_runs_of_the_engines_loss():
    data = [{"input_ids": [1] * 8}]
    spec = SimpleNamespace(**vars(_spec({"layout": "auto"})), fault_tolerance=None)
    args = _args(pp_microbatches=None, pp_schedule="1F1B", torch_compile=False)
    offered = request_for(spec, args, data, "cpu", can_pipeline=True)
    assert (offered.choose_pp, offered.pp_schedule, offered.pp_microbatches) == (True, "1F1B", None)
    assert not request_for(spec, args, data, "cpu").choose_pp  # a custom loss, a library's trainer
    assert not request_for(SimpleNamespace(**{**vars(spec), "sizes": {"tp": 2}}), args, data, "cpu",
                           can_pipeline=True).choose_pp
    assert not request_for(SimpleNamespace(**{**vars(spec), "sizes": {"pp": 1}}), args, data, "cpu",
                           can_pipeline=True).choose_pp  # pp_size given: kept
    assert not request_for(SimpleNamespace(**{**vars(spec), "world_size": 3}), args, data, "cpu",
                           can_pipeline=True).choose_pp
    assert not request_for(spec, _args(per_device_train_batch_size=3, pp_microbatches=None, pp_schedule="1F1B",
                                       torch_compile=False), data, "cpu", can_pipeline=True).choose_pp


def test_a_pipeline_candidate_idles_for_its_bubble_and_sends_activations():
    rates = Rates(flops_per_s=1.0, link_bytes_per_s=1.0)
    plain = Candidate(sharding="full_shard", ac="none", loss_chunk=0, peak=0, flops=60, wire_bytes=0)
    pipeline = dataclasses.replace(plain, pp=2, bubble=0.25, p2p_bytes=15)
    assert pipeline.name == "pp 2, full_shard, AC none, loss chunk off" and plain.name.startswith("full_shard")
    assert pipeline.step_s(rates) == pytest.approx((60 + 15) / 0.75)


def test_a_traced_pipeline_candidate_counts_the_steps_work_of_its_rank():
    """pp 2 x dp 1 over the same global batch: the rank runs half the layers on twice the micro-batches, so its
    compute is about the data-parallel rank's; it holds less (half the layers' weights and activations)."""
    request = Request(world_size=2, sizes={}, per_device_batch=4, seq_len=16, gradient_accumulation_steps=1,
                      mixed_precision="no", target="cpu", choose_sharding=False, choose_ac=False,
                      choose_loss_chunk=False, choose_pp=True)
    config = FSDPConfig.load({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "layout": "auto"})
    plain, pipeline = sorted(trace_candidates(tiny_llama(layers=4), config, request)[0], key=lambda c: c.pp)
    assert (plain.pp, pipeline.pp) == (1, 2) and pipeline.bubble == pytest.approx(1 / 3)  # 1F1B, 2 microbatches
    assert pipeline.flops == pytest.approx(plain.flops, rel=0.15) and pipeline.peak < plain.peak
    assert pipeline.p2p_bytes == 2 * 4 * 16 * 32 * 4 * 2  # both directions, 2 micro-batches, hidden 32, fp32
    gpt2 = trace_candidates(tiny_gpt2(), FSDPConfig.load({"layout": "auto"}), request)[0]
    assert {c.pp for c in gpt2} == {1}  # no pipeline plan: no pipeline candidate


def test_predicted_step_adds_every_cost():
    candidate = Candidate(sharding="full_shard", ac="selective", loss_chunk=0, peak=0, flops=1e9, wire_bytes=1e6,
                          ops=1000, collective_calls=10, selective_ops=100)
    rates = Rates(flops_per_s=1e10, link_bytes_per_s=1e7, s_per_collective=1e-3, s_per_op=1e-5,
                  s_per_selective_op=1e-4)
    assert candidate.step_s(rates) == pytest.approx(0.1 + 0.1 + 0.01 + 0.01 + 0.01)


def test_gradient_reductions_overlap_all_but_the_last_unit():
    """Of n units' gradient reductions (reduce-scatter, all-reduce) the last one's share is exposed; all-gathers
    are not hidden."""
    rates = Rates(flops_per_s=1.0, link_bytes_per_s=1.0)
    wire = {"allgather": 100, "reduce_scatter": 80, "allreduce": 40}
    one = Candidate(sharding="full_shard", ac="none", loss_chunk=0, peak=0, flops=0, wire_bytes=220,
                    wire_by_kind=wire)
    four = dataclasses.replace(one, units=4)
    assert one.step_s(rates) == pytest.approx(220)
    assert four.step_s(rates) == pytest.approx(100 + (80 + 40) / 4)


def test_traced_op_counts():
    """The trace counts ops, collectives and the ops selective checkpointing's policy sees (its host costs)."""
    request = Request(world_size=2, sizes={}, per_device_batch=2, seq_len=16, gradient_accumulation_steps=1,
                      mixed_precision="no", target="cpu", choose_sharding=False, choose_ac=True,
                      choose_loss_chunk=False)
    config = FSDPConfig.load({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "layout": "auto"})
    by = {c.ac: c for c in trace_candidates(tiny_llama(), config, request)[0]}
    assert by["none"].selective_ops == by["full"].selective_ops == 0 < by["selective"].selective_ops
    assert by["none"].ops < by["selective"].ops and by["none"].ops < by["full"].ops  # recomputation
    # full_shard on 2 ranks: per unit an all-gather in forward, one in backward and a reduce-scatter (an
    # all-to-all on gloo), whatever the checkpointing
    assert by["none"].collective_calls == by["full"].collective_calls > 0


def test_one_unit_candidate_on_cpu():
    """Plain data parallel with the whole model as one FSDP unit: the same peak as per-layer no_shard, fewer ops and
    collectives (one gradient all-reduce); offered with activation checkpointing none only (AC needs units)."""
    request = Request(world_size=2, sizes={}, per_device_batch=2, seq_len=16, gradient_accumulation_steps=1,
                      mixed_precision="no", target="cpu", choose_sharding=True, choose_ac=True, choose_loss_chunk=False,
                      choose_units=True)
    config = FSDPConfig.load({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "layout": "auto"})
    candidates = trace_candidates(tiny_llama(), config, request)[0]
    by = {(c.sharding, c.ac): c for c in candidates}
    assert len(candidates) == 10 and [ac for sharding, ac in by if sharding == "no_shard_one_unit"] == ["none"]
    one, layers = by[("no_shard_one_unit", "none")], by[("no_shard", "none")]
    assert one.peak == layers.peak and one.flops == layers.flops and one.wire_bytes == layers.wire_bytes
    assert one.collective_calls == 2 < layers.collective_calls  # the gradients' all-reduce and the norm's
    assert (one.units, layers.units) == (1, 3)  # the root; with 2 decoder layers of their own
    # its all-reduce is exposed whole, the per-layer one's only a third: the same bytes, one predicted slower on it
    rates = Rates(flops_per_s=1e12, link_bytes_per_s=1e6)
    assert one.step_s(rates) > layers.step_s(rates)
    assert one.ops < layers.ops
    applied = one.apply(config)
    assert (applied.replicate_only, applied.auto_wrap_policy, applied.ac_mode) == (True, "NO_WRAP", "none")
    # activation checkpointing set by the user: no one-unit candidate
    checkpointed = dataclasses.replace(config, activation_checkpointing=True)
    assert "no_shard_one_unit" not in {c.sharding for c in trace_candidates(
        tiny_llama(), checkpointed, dataclasses.replace(request, choose_ac=False))[0]}
