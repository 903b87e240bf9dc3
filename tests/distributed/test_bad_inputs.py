"""Bad input is one clear error before training, raised together on every rank, and nothing on disk changes.

All table cases run in one 2-rank process group (`workers/bad_inputs.py`); a few run as whole jobs under
`shardtrain launch` to check what a user sees: exit status 1, one `error:` line, no traceback."""

import importlib.util
import json
from pathlib import Path

import pytest
from launch import REPO, error_lines, shardtrain_launch, torchrun, worker_env

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
kw = {"args": {"max_grad_norm": float("nan")}, "wandb": {"report_to": ["wandb"]},
      "reshard": {"fsdp_config": {"reshard_after_forward": 3}}}.get(kind, {})
args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2, save_strategy="no", **kw)
if kind == "data":
    data = data + [{"input_ids": [1, 2, 300]}]
Trainer(tiny_llama(), args, train_dataset=data).train()
"""

# kind: (launch flags, the one error line's start); "wandb" runs without a key, a netrc or offline mode
LAUNCH_CASES = {"args": ((), "error: TrainingArguments.max_grad_norm must be a finite number"),
         "data": ((), "error: train_dataset[16] has token id 300"),
         "fsdp_off": (("--fsdp", "false"), "error: Trainer runs on 2 ranks but fsdp is off"),
         "reshard": ((), "error: fsdp_config key 'reshard_after_forward' is 3, which does not divide the 2 ranks"),
         "wandb": ((), "error: report_to includes 'wandb', but Weights & Biases has no API key here")}


@pytest.mark.parametrize("kind", list(LAUNCH_CASES))
def test_user_sees_one_line_and_exit_1(tmp_path, kind):
    flags, expected = LAUNCH_CASES[kind]
    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(SCRIPT)
    out.mkdir()
    (out / "keep.txt").write_text("a file of the user's")
    env = {k: v for k, v in worker_env(HOME=str(tmp_path)).items() if not k.startswith("WANDB_")}
    proc = shardtrain_launch(script, 2, kind, str(out), flags=flags, env=env, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert lines and lines[0].startswith(expected), proc.stderr[-3000:]
    # not repeated by rank 1, nor by the launcher (the rank's reply through torchrun's error file says it printed)
    assert lines == [lines[0]], lines
    assert "closing signal" not in proc.stderr and "failed (exitcode" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "a file of the user's"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
