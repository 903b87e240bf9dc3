"""`shardtrain launch --max_restarts 2` continues a run exactly, with no resume logic in the script: a rank
SIGKILLed at a random step, a rank SIGKILLed in the middle of a save, a newest checkpoint damaged before
the restart (skipped with a warning), and a rank sent SIGTERM (preemption: every rank checkpoints the last
finished step and exits 143; `--max_restarts 1`) all end with final weights bit-identical to an uninterrupted
run."""

import json
import random

import pytest
import torch
from conftest import SCRIPTS, explain, launch_ok, launch_pooled
from safetensors.torch import load_file

SCRIPT = SCRIPTS / "train_restart.py"
TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
RNG = random.Random(20261129)  # the trials are random but fixed, so a failure can be replayed
SAVE_POINTS = ("save_start", "after_model", "before_commit", "before_rotate")
DAMAGES = ("truncate", "rng", "state", "manifest", "scheduler")
# kill: after step 3..7 (a checkpoint exists by then); mid_save: each save point once, at step 4 or 6; damaged:
# the newest checkpoint is damaged before the kill at step 5 or 7. Ranks and checkpoint types alternate; every trial
# is distinct, and each kind of fault meets both checkpoint types. (Each trial is a real launch that restarts, ~25 s
# of both cores: these 15 are a third of one test worker's time.)
_KILL_STEPS = RNG.sample(range(3, 8), 2)
_SAVE_FAULTS = [(point, RNG.choice((4, 6))) for point in SAVE_POINTS]
# SIGTERM: at the start of a step, at its end, while it logs, or while it saves (steps 4 and 6 save)
_TERM_POINTS = ("step_begin", "step_end", "log", "save")
_TERM_STEPS = [RNG.choice((4, 6)) if point == "save" else RNG.randrange(3, 8) for point in _TERM_POINTS]
TRIALS = (
    [("kill", TYPES[i % 2], f"{i % 2}:{_KILL_STEPS[i]}", None) for i in range(2)]
    + [("term", TYPES[i % 2], f"{(i + 1) % 2}:{_TERM_STEPS[i]}:term:{point}", None)
       for i, point in enumerate(_TERM_POINTS)]
    + [("mid_save", TYPES[i % 2], None, f"{point}:{(i + 1) % 2}:{step}")
       for i, (point, step) in enumerate(_SAVE_FAULTS)]
    + [("damaged", TYPES[i % 2], f"{i % 2}:{RNG.choice((5, 7))}:{DAMAGES[i]}", None) for i in range(5)]
)


def _launch(home, out, kind, kill=None, fault=None, restarts=2):
    extra = {"SHARDTRAIN_FAULT": fault} if fault else {}
    args = [out, kind] + ([kill] if kill else [])
    return launch_ok(home, "--cpu", "--num_processes", 2, "--max_restarts", restarts, SCRIPT, *args, **extra)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    home = root / "home"
    out = {}
    for kind in TYPES:  # uninterrupted: the launch is not under test here, so the session's rank pool runs it
        launch_pooled(home, "--cpu", "--num_processes", 2, SCRIPT, root / kind, kind)
        out[kind] = load_file(root / kind / "final" / "model.safetensors")
    return out


@pytest.mark.parametrize("trial", range(len(TRIALS)), ids=[f"{t[0]}-{t[1][:4]}-{t[2] or t[3]}" for t in TRIALS])
def test_restart_resumes_to_the_same_weights(references, tmp_path, trial):
    what, kind, kill, fault = TRIALS[trial]
    out = tmp_path / "run"
    proc = _launch(tmp_path / "home", out, kind, kill=kill, fault=fault, restarts=1 if what == "term" else 2)
    log = proc.stdout + proc.stderr
    assert "Resuming from" in log, explain(proc)  # it did restart and pick a checkpoint by itself
    if what == "term":  # every rank stopped at the same step boundary, wrote that step, and exited 143
        step = int(kill.split(":")[1])
        assert f"preempted (SIGTERM) after step {step}; wrote" in log and "exiting 143" in log, explain(proc)
        assert f"Resuming from {out}/checkpoint-{step}" in log, explain(proc)
    if what == "damaged":
        assert "skipping damaged checkpoint" in log, explain(proc)
    final = load_file(out / "final" / "model.safetensors")
    assert final.keys() == references[kind].keys()
    for key, ref in references[kind].items():
        assert torch.equal(final[key], ref), key
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]
    # metrics.jsonl: the steps replayed after the restart are logged once, not twice
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == list(range(1, 9))


def test_pipeline_restart_after_a_kill_resumes_to_the_same_weights(tmp_path):
    """pp 2 given as the launcher's flag: rank 1 (the last stage) SIGKILLed after step 5 of a run with dropout;
    the restarted group resumes from checkpoint-4 and ends bit-identical to an uninterrupted pp 2 run."""
    pp = ("--use_parallelism_config", "--parallelism_config_pp_size", 2)
    kind = "FULL_STATE_DICT"
    reference = tmp_path / "reference"
    launch_pooled(tmp_path / "home", "--cpu", "--num_processes", 2, *pp, SCRIPT, reference, kind)
    out = tmp_path / "run"
    proc = launch_ok(tmp_path / "home", "--cpu", "--num_processes", 2, "--max_restarts", 1, *pp, SCRIPT, out, kind,
                     "1:5")
    log = proc.stdout + proc.stderr
    assert f"Resuming from {out}/checkpoint-4" in log, explain(proc)
    assert "layout: pp 2 x dp_replicate 1 x dp_shard 1" in log, explain(proc)
    final, expected = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" /
                                                                                  "model.safetensors")
    assert final.keys() == expected.keys()
    for key, ref in expected.items():
        assert torch.equal(final[key], ref), key
