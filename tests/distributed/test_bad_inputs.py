"""Bad input is one clear error before training, raised together on every rank, and nothing on disk changes.

All table cases run in one 2-rank process group (`workers/bad_inputs.py`); a few run as whole jobs under
`shardtrain launch` to check what a user sees: exit status 1, one `error:` line, no traceback."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO, torchrun, worker_env

WORKER = Path(__file__).parent / "workers" / "bad_inputs.py"
_spec = importlib.util.spec_from_file_location("bad_inputs_cases", WORKER)
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
CASES = _cases.CASES


def test_there_are_at_least_60_cases_in_every_group():
    groups = {group for group, *_ in CASES.values()}
    assert len(CASES) >= 60 and groups == {"arguments", "environment", "dataset", "checkpoint", "output", "parallelism"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    torchrun(WORKER, 2, str(root), timeout=900)
    return json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_case(results, name):
    got = results[name]
    assert got["raised"] is not None and not got.get("not_user_error"), got
    for fragment in got["fragments"]:
        assert fragment in got["message"], (fragment, got["message"])
    assert not got["chained"], "the message must stand alone, without a chained traceback"
    assert got["files_unchanged"], "a failed run must not change files that were there"
    assert got["same_on_every_rank"]


SCRIPT = """
import sys
from tiny_models import tiny_llama, variable_length_dataset
from shardtrain import Trainer, TrainingArguments
kind, out = sys.argv[1], sys.argv[2]
data = variable_length_dataset(n=16)
kw = {"max_grad_norm": float("nan")} if kind == "args" else {}
args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2, save_strategy="no", **kw)
if kind == "data":
    data = data + [{"input_ids": [1, 2, 300]}]
Trainer(tiny_llama(), args, train_dataset=data).train()
"""


@pytest.mark.parametrize("kind,expected", [("args", "error: TrainingArguments.max_grad_norm must be a finite number"),
                                           ("data", "error: train_dataset[16] has token id 300")])
def test_user_sees_one_line_and_exit_1(tmp_path, kind, expected):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "shardtrain.cli.main", "launch", "--cpu", "--num_processes", "2",
                           str(script), kind, str(tmp_path / "out")], env=worker_env(), capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # torchrun prefixes worker lines with "[rankN]: "
    lines = [line.split("]: ", 1)[-1] for line in proc.stderr.splitlines() if "error: " in line]
    lines = [line for line in lines if line.startswith("error: ")]
    assert lines[0].startswith(expected), proc.stderr[-3000:]
    assert len([line for line in lines if line.startswith(expected)]) == 1  # not repeated by rank 1
    # rank 0 exits 1 after printing; torchrun may stop rank 1 (-15) before it exits by itself
    assert "failed (exit codes by global rank: {0: 1" in lines[-1] or ", 0: 1}" in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
