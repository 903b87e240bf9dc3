"""The planner traces the chunked loss (`loss_chunk_size`): its loss part (head + cross entropy) and peak."""

from __future__ import annotations

import json

import pytest
from transformers import Gemma2Config, LlamaConfig

from shardtrain.cli.main import main as cli_main
from shardtrain.errors import PlanError
from shardtrain.plan import plan

BIG_VOCAB = {"vocab_size": 128256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
             "tie_word_embeddings": False, "use_cache": False}
TOKENS = 2 * 256  # per-device batch x seq_len


def _plan(chunk, **kwargs):
    return plan(LlamaConfig(**BIG_VOCAB), world_size=2, per_device_batch=2, seq_len=256, target="cpu",
                estimate_step_time=False, what_if=False, loss_chunk_size=chunk, **kwargs)


@pytest.fixture(scope="module")
def plans():
    return {chunk: _plan(chunk) for chunk in (None, 64)}


def test_chunking_cuts_the_loss_part_and_the_peak(plans):
    full, chunked = plans[None], plans[64]
    logits = TOKENS * BIG_VOCAB["vocab_size"] * 4  # fp32
    assert full.trace.logits == logits and chunked.trace.logits == 0
    # unchunked: logits, their log-softmax kept for backward and its gradient (3 x the logits, within 5 %)
    assert full.trace.loss_peak == pytest.approx(3 * logits, rel=0.05)
    # chunked: the same for 64 tokens at a time (the head's gradient, 16 MiB, comes on top in both)
    assert chunked.trace.loss_peak <= 3 * 64 * BIG_VOCAB["vocab_size"] * 4 + 2 * 2**20
    assert full.trace.loss_peak >= 3 * chunked.trace.loss_peak
    assert full.peak - chunked.peak >= 0.9 * (full.trace.loss_peak - chunked.trace.loss_peak)
    assert chunked.settings["loss_chunk_size"] == 64 and full.settings["loss_chunk_size"] == 0
    rows = {row.name: row for row in chunked.rows}
    assert rows["loss part (head + loss)"].bytes == chunked.trace.loss_peak
    assert "64 tokens per chunk" in rows["loss part (head + loss)"].note
    assert chunked.to_dict()["loss_part_bytes"] == chunked.trace.loss_peak


def test_auto_and_cli(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BIG_VOCAB, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    code = cli_main(["plan", str(path), "--world-size", "2", "--batch", "2", "--seq-len", "256", "--target", "cpu",
                     "--no-step-time", "--loss-chunk-size", "auto", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["loss_chunk_size"] == 512  # "auto" for a 128k vocabulary: 512 tokens per chunk
    assert out["loss_part_bytes"] > 0


def test_refusals():
    gemma = Gemma2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(Exception, match="final_logit_softcapping"):
        plan(gemma, per_device_batch=1, seq_len=16, target="cpu", estimate_step_time=False, what_if=False,
             loss_chunk_size=32)
    auto = plan(gemma, per_device_batch=1, seq_len=16, target="cpu", estimate_step_time=False, what_if=False,
                loss_chunk_size="auto")
    assert auto.settings["loss_chunk_size"] == 0  # falls back to the unchunked loss, as the Trainer does
    with pytest.raises(PlanError, match="loss_chunk_size"):
        _plan(-4)
