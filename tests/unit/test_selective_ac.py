"""Selective (per-op) activation checkpointing: the fsdp_config values, what the policy keeps and recomputes, and
that it trains exactly like no checkpointing (dropout included). Multi-rank equality: test_fsdp_equivalence.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtrain import TrainingArguments, TrainingArgumentsError
from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.config.run_spec import RunSpec
from shardtrain.errors import FSDPConfigError
from shardtrain.parallel.activation_checkpoint import ForwardResidue, wrap_checkpointing
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.xla import XlaBackend

MODES = ("none", "selective", "full")


@pytest.mark.parametrize("value,stored,mode", [
    (False, False, "none"), ("none", False, "none"), ("false", False, "none"),
    (True, True, "full"), ("full", True, "full"), ("TRUE", True, "full"),
    ("selective", "selective", "selective"), (" Selective ", "selective", "selective"),
])
def test_values_parse(value, stored, mode):
    config = FSDPConfig.load({"activation_checkpointing": value})
    assert config.activation_checkpointing == stored and config.ac_mode == mode
    assert FSDPConfig.load(config.to_dict()).ac_mode == mode  # round trip through JSON types
    assert FSDPConfig.load({"fsdp_activation_checkpointing": value}).ac_mode == mode  # Accelerate's spelling


def test_mode_of_a_value_set_after_load():
    """Code that sets the attribute later (the planner's override, TrainingArguments) gets the same reading."""
    config = FSDPConfig.load({"activation_checkpointing": True})
    config.activation_checkpointing = "none"  # truthy as a string, still no checkpointing
    assert config.ac_mode == "none"
    config.activation_checkpointing = "partial"
    with pytest.raises(FSDPConfigError, match="'activation_checkpointing' got 'partial'"):
        _ = config.ac_mode


@pytest.mark.parametrize("value,extra", [("partial", ""), (2, "every Nth layer is not supported"), (None, ""),
                                         (["selective"], "")])
def test_bad_values_name_key_value_and_fix(value, extra):
    with pytest.raises(FSDPConfigError) as err:
        FSDPConfig.load({"activation_checkpointing": value})
    message = str(err.value)
    for fragment in ("'activation_checkpointing'", repr(value), '"selective"', '"full"', extra):
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("value", [True, "selective"])
def test_conflicts_hold_for_every_checkpointing_value(tmp_path, value):
    with pytest.raises(FSDPConfigError, match="both 'activation_checkpointing' and 'xla_fsdp_grad_ckpt'"):
        FSDPConfig.load({"activation_checkpointing": value, "xla": True, "xla_fsdp_grad_ckpt": True})
    with pytest.raises(TrainingArgumentsError, match="gradient_checkpointing"):
        TrainingArguments(output_dir=str(tmp_path), fsdp=True, gradient_checkpointing=True,
                          fsdp_config={"activation_checkpointing": value})
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True,
                             fsdp_config={"xla": True, "xla_fsdp_v2": True, "activation_checkpointing": value})
    with pytest.raises(FSDPConfigError, match="use 'xla_fsdp_grad_ckpt': true"):
        XlaBackend(RunSpec.resolve(args)).check(None, ParallelDims.resolve(world_size=1))


def _llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.3, attn_implementation=attn, use_cache=False)
    return LlamaForCausalLM(config)


def _step(base: LlamaForCausalLM, mode: str) -> dict:
    """One forward + backward of a copy of `base` under `mode`: loss, gradients, what forward left alive and
    the ops that ran in backward (recomputation included)."""
    model = copy.deepcopy(base)
    if mode != "none":
        wrap_checkpointing(model, list(model.model.layers), mode)
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # the dropout masks
    with ForwardResidue() as forward:
        loss = model(input_ids=batch, labels=batch).loss
    live = forward.live_bytes()
    with ForwardResidue() as backward:
        loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "live": live, "backward_ops": backward.ops}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_policy_saves_matmuls_recomputes_the_rest(attn):
    base = _llama(attn)
    runs = {mode: _step(base, mode) for mode in MODES}
    none, selective, full = (runs[m] for m in MODES)
    # activation memory strictly between: a layer keeps its matmul / attention outputs, not the cheap ops'
    assert full["live"] < selective["live"] < none["live"]
    aten = torch.ops.aten

    def recomputed(run: dict, op) -> int:  # ops backward ran beyond those of no checkpointing
        return run["backward_ops"][op] - none["backward_ops"][op]

    # 7 Linear layers per decoder layer (q, k, v, o, gate, up, down), 2 layers: selective keeps the 1st, 3rd,
    # 5th and 7th of each layer and recomputes 3; full recomputes 6 (non-reentrant checkpointing stops once it
    # has what backward needs, and nothing needs the output of down_proj)
    assert recomputed(selective, aten.mm.default) == 2 * 3
    assert recomputed(full, aten.mm.default) == 2 * 6
    assert recomputed(selective, aten.bmm.default) == 0 < recomputed(full, aten.bmm.default)  # attention kept
    norms = (aten.rsqrt.default, aten.mul.Tensor, aten.silu.default)
    for op in norms:  # RMSNorm, SiLU, rotary: recomputed by both
        assert recomputed(selective, op) > 0 and recomputed(full, op) > 0, op
    # the dropout masks are drawn again in the recomputation, from the stashed RNG state: same training
    for mode in ("selective", "full"):
        assert runs[mode]["loss"] == pytest.approx(none["loss"], abs=1e-6, rel=0)
        for name, grad in none["grads"].items():
            torch.testing.assert_close(runs[mode]["grads"][name], grad, atol=1e-6, rtol=0, msg=name)


def test_dropout_really_draws():
    """The comparison above is meaningful: another dropout seed gives another loss."""
    base = _llama("eager")
    first = _step(base, "selective")["loss"]
    model = copy.deepcopy(base)
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(6)
    assert model(input_ids=batch, labels=batch).loss.item() != pytest.approx(first, abs=1e-6)
