"""The README's main job, shortened: 2 ranks through `shardtrain launch`, loss falls, model and checkpoint saved."""

import json
import subprocess
import sys
from pathlib import Path

from launch import REPO, worker_env
from transformers import LlamaForCausalLM

from shardtrain.parallel.distributed import find_free_port


def test_demo_trains_and_saves(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "shardtrain.cli.main", "launch", "--cpu", "--num_processes", "2",
           "--main_process_port", str(find_free_port()), str(REPO / "examples" / "train_demo.py"),
           "--max_steps", "30", "--output_dir", str(out)]
    proc = subprocess.run(cmd, env=worker_env(SHARDTRAIN_HOME=str(tmp_path / "home")), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "summary" in proc.stdout
    assert summary["ranks"] == 2 and summary["steps"] == 30
    assert summary["final_train_loss"] < summary["first_train_loss"]
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert summary["eval_token_accuracy_after"] > summary["eval_token_accuracy_before"]
    assert Path(summary["checkpoint"]) == out / "checkpoint-30"
    assert (out / "checkpoint-30" / "sharded" / ".metadata").is_file()
    model = LlamaForCausalLM.from_pretrained(str(out / "final"))
    assert model.config.num_hidden_layers == 4
