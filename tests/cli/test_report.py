"""Seeing a run: metrics.jsonl always (tokens/s, per-rank peak memory), TensorBoard scalars when asked,
report.png at the end of train(), and `shardtrain report OUTPUT_DIR` drawing it again afterwards."""

import json
import subprocess
import sys
from pathlib import Path

from launch import REPO, torchrun, worker_env
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

WORKER = REPO / "tests" / "distributed" / "workers" / "train_run.py"


def test_tensorboard_jsonl_and_report(tmp_path):
    out = tmp_path / "run"
    torchrun(WORKER, 2, json.dumps([{"out": str(out), "per_device_train_batch_size": 4, "max_steps": 6,
                                     "report_to": "tensorboard", "eval_strategy": "steps", "eval_steps": 3}]))
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in entries if "loss" in e]
    assert [e["step"] for e in train] == [1, 2, 3, 4, 5, 6]
    assert all(len(e["peak_memory_mb_per_rank"]) == 2 and e["memory_kind"] == "cpu_peak_rss" for e in train)
    assert [e["step"] for e in entries if "eval_loss" in e][:2] == [3, 6]
    # TensorBoard: the same numbers, read back from the event files
    # transformers' TensorBoardCallback: one run directory on rank 0, its tag names ("train/loss", "eval/loss")
    (runs,) = (out / "runs").iterdir()
    accumulator = EventAccumulator(str(runs))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss", "train/tokens_per_second"} <= \
        set(scalars)
    logged = [(e.step, e.value) for e in accumulator.Scalars("train/loss")]
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert all(abs(v - e["loss"]) < 1e-6 for (_, v), e in zip(logged, train, strict=True))
    # report.png drawn by train(), and again by the command
    assert imread(out / "report.png").std() > 0.01
    again = tmp_path / "again.png"
    proc = subprocess.run([sys.executable, "-m", "shardtrain.cli.main", "report", str(out), "--out", str(again)],
                          env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert imread(again).shape == imread(out / "report.png").shape
    missing = subprocess.run([sys.executable, "-m", "shardtrain.cli.main", "report", str(tmp_path / "nothing")],
                             env=worker_env(), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr
    assert not Path(tmp_path / "nothing").exists()
