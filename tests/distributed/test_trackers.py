"""report_to through transformers' own integration callbacks, offline: Weights & Biases, MLflow, Trackio,
TensorBoard, Comet and SwanLab each write one run (rank 0 only, of two ranks) holding the losses shardtrain
logged."""

import json
import sqlite3
import zipfile
from pathlib import Path

import pytest
from launch import read_json, torchrun, worker_env
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

WORKER = Path(__file__).parent / "workers" / "trackers.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    env = worker_env(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", HF_HUB_OFFLINE="1",
                     MLFLOW_TRACKING_URI=f"file:{root / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true",
                     TRACKIO_DIR=str(root / "trackio"), COMET_START_ONLINE="false",
                     COMET_OFFLINE_DIRECTORY=str(root / "comet"), SWANLAB_MODE="offline",
                     SWANLAB_LOG_DIR=str(root / "swanlog"))
    # a fresh launch: trackers start services and read their environment once per process, and end at exit
    torchrun(WORKER, 2, str(root / "out"), env=env, pooled=False)
    return root, read_json(root / "out" / "result.json")


def test_each_tracker_is_transformers_callback(run):
    _, result = run
    assert {"WandbCallback", "MLflowCallback", "TrackioCallback", "TensorBoardCallback", "CometCallback",
            "SwanLabCallback"} <= set(result["callbacks"])
    assert len(result["losses"]) == 3


def test_wandb_offline_run(run):
    root, result = run
    runs = list((root / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # rank 0 only
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"train/loss" in data and all(json.dumps(loss).encode() in data for loss in result["losses"])


def test_mlflow_run(run):
    root, result = run
    runs = [p for p in (root / "mlruns" / "0").iterdir() if p.is_dir()]
    assert len(runs) == 1
    rows = (runs[0] / "metrics" / "loss").read_text().split("\n")
    logged = [(int(step), float(value)) for _, value, step in (r.split() for r in rows if r)]
    assert logged == [(i + 1, pytest.approx(loss, abs=1e-7)) for i, loss in enumerate(result["losses"])]
    assert (runs[0] / "metrics" / "peak_memory_mb_per_rank_1").is_file()  # per-rank lists as scalars


def test_trackio_run(run):
    root, result = run
    with sqlite3.connect(root / "trackio" / "st.db") as db:
        rows = list(db.execute("select run_name, step, metrics from metrics order by step"))
    assert {name for name, _, _ in rows} == {"shardtrain-trackers"}
    losses = [json.loads(metrics)["train/loss"] for _, _, metrics in rows if b"train/loss" in metrics]
    assert losses == pytest.approx(result["losses"], abs=1e-7)


def test_tensorboard_run(run):
    root, result = run
    event_dirs = list((root / "out" / "runs").iterdir())
    assert len(event_dirs) == 1 and len(list(event_dirs[0].glob("events.out.tfevents.*"))) == 1
    accumulator = EventAccumulator(str(event_dirs[0]))
    accumulator.Reload()
    logged = [(e.step, e.value) for e in accumulator.Scalars("train/loss")]
    assert logged == [(i + 1, pytest.approx(loss, abs=1e-6)) for i, loss in enumerate(result["losses"])]


def test_comet_offline_run(run):
    root, result = run
    archives = list((root / "comet").glob("*.zip"))
    assert len(archives) == 1  # rank 0 only
    with zipfile.ZipFile(archives[0]) as archive:
        messages = [json.loads(line) for line in archive.read("messages.json").decode().splitlines() if line]
    logged = [(m["payload"]["metric"]["step"], m["payload"]["metric"]["metricValue"]) for m in messages
              if m["type"] == "metric_msg" and m["payload"]["metric"]["metricName"] == "train/loss"]
    # Comet also records what the TensorBoard callback writes (its SummaryWriter auto-logging): each step once or
    # twice, always the logged loss
    assert sorted({step for step, _ in logged}) == [1, 2, 3]
    assert all(value == pytest.approx(result["losses"][step - 1], abs=1e-6) for step, value in logged)


def test_swanlab_offline_run(run):
    root, result = run
    runs = list((root / "swanlog").glob("run-*"))
    assert len(runs) == 1  # rank 0 only
    # swanlab's own reader of its backup (a LevelDB-style log: a record may be split over 32 KiB blocks)
    from swanlab.data.porter.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(runs[0] / "backup.swanlab"))
    records = [json.loads(record) for record in store]
    logged = [(r["data"]["step"], r["data"]["metric"]["data"]) for r in records
              if r["model_type"] == "Scalar" and r["data"]["key"] == "train/loss"]
    assert logged == [(i + 1, pytest.approx(loss, abs=1e-7)) for i, loss in enumerate(result["losses"])]
