"""The planner models selective activation checkpointing: its traced step runs the SAC policy inside the
checkpoint wrappers, so activations and the peak fall between no checkpointing and full checkpointing.

    OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1 /work/main/.venv/bin/python -m pytest tests/plan/test_plan_selective_ac.py -q
"""

from __future__ import annotations

import json

from transformers import LlamaConfig

from shardtrain.cli.main import main
from shardtrain.plan import plan

LAYERS = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, use_cache=False)


def test_selective_lies_between_none_and_full():
    result = plan(_config(), fsdp_config={**LAYERS, "activation_checkpointing": "selective"}, world_size=2,
                  per_device_batch=2, seq_len=32, target="cpu", estimate_step_time=False, device_memory=1,
                  what_if=True)
    traces = result.ac_traces
    assert set(traces) == {"none", "selective", "full"} and traces["selective"] is result.trace
    assert traces["full"].peak < traces["selective"].peak < traces["none"].peak
    assert result.peak == traces["selective"].peak
    layer = {mode: dict(t.layer_activations)["model.layers.0"] for mode, t in traces.items()}
    assert layer["full"] < layer["selective"] < layer["none"]
    rows = {r.name: r.bytes for r in result.rows}
    assert rows["activations per layer (sel. AC)"] == layer["selective"]
    assert rows["activations per layer (no AC)"] == layer["none"]
    assert rows["activations per layer (with AC)"] == layer["full"]
    # the flipped trace of selective is full, the one change that keeps less; reported with its peak
    assert result.what_if_ac is traces["full"]
    assert [o["change"] for o in result.fit["options"] if o["change"].startswith("activation_checkpointing")] == [
        "activation_checkpointing: true"]
    out = result.to_dict()
    assert out["settings"]["fsdp_config"]["activation_checkpointing"] == "selective"
    assert out["what_if_activation_checkpointing_peak_bytes"] == {m: t.peak for m, t in traces.items()}
    json.dumps(out)
    assert "activation_checkpointing selective" in result.table()


def test_without_checkpointing_both_modes_are_advised():
    result = plan(_config(), fsdp_config=LAYERS, world_size=2, per_device_batch=2, seq_len=32, target="cpu",
                  estimate_step_time=False, device_memory=1, what_if=True)
    options = {o["change"]: o["peak"] for o in result.fit["options"]
               if o["change"].startswith("activation_checkpointing")}
    assert options == {'activation_checkpointing: "selective"': result.ac_traces["selective"].peak,
                       "activation_checkpointing: true": result.ac_traces["full"].peak}
    assert result.what_if_ac is result.ac_traces["full"]


def test_cli_takes_the_mode(tmp_path, capsys):
    _config().save_pretrained(tmp_path)
    args = ["plan", str(tmp_path / "config.json"), "--world-size", "1", "--batch", "1", "--seq-len", "16", "--json",
            "--no-step-time", "--target", "cpu", "--fsdp-config", json.dumps(LAYERS)]
    assert main([*args, "--activation-checkpointing", "selective"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["fsdp_config"]["activation_checkpointing"] == "selective"
    assert set(out["what_if_activation_checkpointing_peak_bytes"]) == {"none", "selective", "full"}
    assert main([*args, "--activation-checkpointing", "partial"]) == 2  # argparse's usage error
    assert "'activation_checkpointing' got 'partial'" in capsys.readouterr().err
