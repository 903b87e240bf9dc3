"""The README's main job, shortened: 2 ranks through `shardtrain launch`, loss falls, model and checkpoint saved."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO, worker_env
from transformers import LlamaForCausalLM


def _exact_match_in_one_process(model) -> float:
    """The demo's eval set answered by `generate` on the saved model, one sample at a time, no FSDP."""
    sys.path.insert(0, str(REPO / "examples"))
    from train_demo import make_dataset

    hits, samples = 0, make_dataset(512, seed=2, digits=2)
    with torch.no_grad():
        for sample in samples:
            start = next(i for i, label in enumerate(sample["labels"]) if label != -100)
            answer = sample["labels"][start:]
            prompt = torch.tensor([sample["input_ids"][:start]])
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=len(answer), do_sample=False, pad_token_id=0)
            hits += out[0, start:].tolist()[:len(answer)] == answer
    return hits / len(samples)


def test_demo_trains_and_saves(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "shardtrain.cli.main", "launch", "--cpu", "--num_processes", "2",
           str(REPO / "examples" / "train_demo.py"),
           "--max_steps", "150", "--output_dir", str(out)]
    proc = subprocess.run(cmd, env=worker_env(SHARDTRAIN_HOME=str(tmp_path / "home")), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "summary" in proc.stdout
    assert summary["ranks"] == 2 and summary["steps"] == 150 and summary["seed"] == 0
    assert summary["final_train_loss"] < summary["first_train_loss"]
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert summary["eval_token_accuracy_after"] > summary["eval_token_accuracy_before"]
    assert Path(summary["checkpoint"]) == out / "checkpoint-150"
    assert (out / "checkpoint-150" / "sharded" / ".metadata").is_file()
    model = LlamaForCausalLM.from_pretrained(str(out / "final"))
    assert model.config.num_hidden_layers == 4
    assert summary["generated_exact_match"] > 0  # some answers are right after 150 steps ...
    assert summary["generated_exact_match"] == _exact_match_in_one_process(model)  # ... the same ones
    # the run's picture: drawn from metrics.jsonl at the end of train(), four panels with data
    from matplotlib.image import imread

    from shardtrain.train.metrics.chart import panel_series, read_metrics

    assert summary["report"] == f"{out}/report.png"
    image = imread(out / "report.png")
    assert image.shape[0] > 300 and image.shape[1] > 500 and image.std() > 0.01  # drawn, not blank
    panels = panel_series(read_metrics(out / "metrics.jsonl"))
    for name in ("loss", "learning_rate", "grad_norm", "throughput_memory"):
        for label, (steps, values) in panels[name].items():
            # the demo evaluates outside train() (eval_loss at steps 0, 150); no step is skipped
            if label not in ("eval loss", "skipped step"):
                assert steps and len(steps) == len(values), (name, label)
    # the evaluations before and after training: the final one was drawn too (report.png redrawn after it)
    assert panels["loss"]["eval loss"][0] == [0, 150]
    assert panels["loss"]["skipped step"] == ([], [])
    assert panels["loss"]["eval loss"][1][-1] == pytest.approx(summary["eval_loss_after"], abs=1e-4)
    assert (out / "report.png").stat().st_mtime >= (out / "metrics.jsonl").stat().st_mtime
    assert "no config file found" not in proc.stderr  # its flags say what a config file would
    entries = read_metrics(out / "metrics.jsonl")
    train = [e for e in entries if "loss" in e]
    assert all(e["memory_kind"] == "cpu_peak_rss" and len(e["peak_memory_mb_per_rank"]) == 2 for e in train)
    assert all(e["tokens_per_second"] > 0 for e in train)
    # Hugging Face's progress bars on stderr (not a terminal here), drawn by rank 0 only: the training bar to
    # its end, and one bar per evaluate()/predict() (before, after, generation), each over its 4 eval batches
    bars = [line for line in proc.stderr.replace("\r", "\n").splitlines() if "%|" in line]
    assert any("150/150" in line for line in bars)
    assert sum(line.lstrip().startswith("0%|") and "| 0/4 " in line for line in bars) == 3
    assert any("| 4/4 " in line for line in bars)
