"""`total_flos` as transformers counts it (6 x non-embedding parameters x input tokens), under every layout:
transformers' own Trainer on one process against ours on FSDP 2 and on a 2-stage pipeline, the same model and
samples. The samples have one length, so every layout's micro-batches hold the same tokens: transformers counts a
batch's padded `input_ids`, shardtrain its real tokens (docs/hugging-face.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from launch import torchrun
from tiny_models import tiny_llama, variable_length_dataset

RUN = Path(__file__).parent / "workers" / "train_run.py"


def test_total_flos_equals_transformers_under_fsdp_and_a_pipeline(tmp_path):
    data = variable_length_dataset(n=48, vocab=64, min_len=12, max_len=12)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=8,
                                          max_steps=3, report_to=[], use_cpu=True, save_strategy="no",
                                          disable_tqdm=True)
    reference = transformers.Trainer(model=tiny_llama(seed=0, tie=True, layers=4), args=args,
                                     train_dataset=[{**d, "labels": d["input_ids"]} for d in data])
    reference.train()
    expected = reference.state.total_flos
    job = {"model": "llama_tied4", "fixed_length": 12, "dataset_size": 48, "max_steps": 3}
    torchrun(RUN, 2, json.dumps([{"out": str(tmp_path / "fsdp2"), "per_device_train_batch_size": 4, **job},
                                 {"out": str(tmp_path / "pp2"), "per_device_train_batch_size": 8, "pp_size": 2,
                                  "pp_microbatches": 2, **job}]), timeout=300)
    for layout in ("fsdp2", "pp2"):
        got = json.loads((tmp_path / layout / "result.json").read_text())["total_flos"]
        assert got == pytest.approx(expected, rel=1e-9), layout  # (before: pp 2 counted its own stage, half)
