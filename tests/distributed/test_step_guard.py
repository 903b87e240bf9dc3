"""The step guard on 2 ranks x accumulation 2: a step whose loss turns NaN (or spikes) is skipped on both ranks,
logged and recorded, and the run ends with the weights of a run on the same data without that batch's samples;
killed and resumed from before the skip, it does not feed those samples again; too many skips in a row stop the
run with one error line and the last checkpoint intact. Also under cp 2, tp 2, ep 2 (a mixture of experts),
packing and a streamed dataset.

    /work/main/.venv/bin/python -m pytest tests/distributed/test_step_guard.py -q
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import error_lines, read_json, shardtrain_launch, torchrun

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.checkpoint.manifest import manifest_problem

WORKER = Path(__file__).parent / "workers" / "step_guard.py"
BATCH_3 = list(range(24, 32))  # the global batch of data step 3 (8 samples: 2 ranks x 2 per device x 2 steps)
BATCH_5 = list(range(40, 48))
GUARD = True
SPIKE = {"spike_factor": 5, "window": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("step_guard")
    jobs = {"nan": {"poison": [27], "step_guard": GUARD}, "reference": {"remove": BATCH_3},
            "spike": {"poison": [43], "kind": "spike", "step_guard": SPIKE, "max_steps": 7},
            "spike_reference": {"remove": BATCH_5, "max_steps": 7},
            "cp": {"poison": [27], "step_guard": GUARD, "cp": True}, "cp_reference": {"remove": BATCH_3, "cp": True},
            "tp": {"poison": [27], "step_guard": GUARD, "tp": True}, "tp_reference": {"remove": BATCH_3, "tp": True},
            "ep": {"poison": [27], "step_guard": GUARD, "ep": True}, "ep_reference": {"remove": BATCH_3, "ep": True},
            "pack": {"poison": [27], "step_guard": GUARD, "pack": True},
            "pack_reference": {"remove": BATCH_3, "pack": True},
            "stream": {"poison": [27], "step_guard": GUARD, "stream": True},
            "stream_reference": {"remove": BATCH_3, "stream": True},
            # killed after the skip (checkpoints at 2 and 4), then resumed from checkpoint-2: before the skip
            "resumed": {"poison": [27], "step_guard": GUARD, "save_steps": 2, "stop_after": 4}}
    listed = [{**job, "out": str(root / name)} for name, job in jobs.items()]
    listed.append({**jobs["resumed"], "out": str(root / "resumed"), "stop_after": None,
                   "resume": str(root / "resumed" / "checkpoint-2")})
    proc = torchrun(WORKER, 2, json.dumps(listed), timeout=900)
    (root / "stderr.txt").write_text(proc.stderr)
    return root


def _weights_difference(root: Path, a: str, b: str) -> float:
    x, y = torch.load(root / a / "weights.pt"), torch.load(root / b / "weights.pt")
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.mark.parametrize("name,reference,batch,reason", [
    ("nan", "reference", BATCH_3, "the loss is nan"),
    ("spike", "spike_reference", BATCH_5, "over 5 x the median"),
    ("cp", "cp_reference", BATCH_3, "the loss is nan"),
    ("tp", "tp_reference", BATCH_3, "the loss is nan"),
    ("ep", "ep_reference", BATCH_3, "the loss is nan"),
    ("pack", "pack_reference", BATCH_3, "the loss is nan"),
    ("stream", "stream_reference", None, "the loss is nan"),
])
def test_a_bad_step_is_skipped_and_the_run_equals_one_without_its_samples(runs, name, reference, batch, reason):
    result, expected = read_json(runs / name / "result.json"), read_json(runs / reference / "result.json")
    assert result["global_step"] == expected["global_step"]  # a skipped step is not counted
    assert result["skipped_steps"] == 1
    [skipped] = result["skipped_batches"]
    assert skipped["epoch"] == 0 and skipped["data_step"] == (5 if name == "spike" else 3)
    assert reason in skipped["reason"] and skipped["samples"] == batch  # a stream's samples have no index
    assert json.loads((runs / name / "skipped_batches.json").read_text()) == [skipped]
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    assert _weights_difference(runs, name, reference) <= 1e-6
    assert f"warning: step_guard: skipped step {skipped['step']} (pass 0, batch {skipped['data_step']})" in \
        (runs / "stderr.txt").read_text()


def test_a_resume_from_before_the_skip_does_not_feed_the_batch_again(runs):
    result = read_json(runs / "resumed" / "result.json")
    assert result["poison_seen"] == 0  # the recorded batch was passed over, never fed to the model
    assert result["skipped_steps"] == 1 and result["global_step"] == 5
    assert _weights_difference(runs, "resumed", "nan") == 0.0  # as if never interrupted


def test_a_resume_on_another_world_size_does_not_feed_the_batch_either(runs, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(runs / "resumed", out)  # its record file, and checkpoint-2 written on 2 ranks before the skip
    shutil.rmtree(out / "checkpoint-4")
    job = {"out": str(out), "poison": [27], "step_guard": GUARD, "save_steps": 2, "resume": str(out / "checkpoint-2")}
    torchrun(WORKER, 1, json.dumps([job]))
    result = read_json(out / "result.json")
    assert result["poison_seen"] == 0 and result["skipped_steps"] == 1 and result["global_step"] == 5
    assert _weights_difference(runs, "nan", str(out)) <= 1e-6  # 1 rank x 4 per device: the same global batch


def test_too_many_skips_in_a_row_stop_with_one_line_and_the_checkpoint_intact(tmp_path):
    out = tmp_path / "run"
    job = {"out": str(out), "poison": [27, 35, 43], "step_guard": {"max_in_a_row": 3}, "save_steps": 2,
           "max_steps": 8}
    proc = shardtrain_launch(WORKER, 2, json.dumps([job]))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [
        "error: step_guard: 3 steps in a row were skipped at step 4 (the loss is nan); stopping, the last checkpoint "
        "(checkpoint-2) is intact. Look at the batches in output_dir/skipped_batches.json, lower the learning rate, "
        "or raise step_guard max_in_a_row"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [p.name for p in CheckpointManager.list_checkpoints(out)] == ["checkpoint-2"]
    assert manifest_problem(out / "checkpoint-2") is None
    assert [e["data_step"] for e in json.loads((out / "skipped_batches.json").read_text())] == [3, 4, 5]
