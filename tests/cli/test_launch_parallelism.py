"""`shardtrain launch` with context parallelism (from flags and from an Accelerate YAML `parallelism_config`
block) and tensor parallelism (flags): run_clm.py on 4 ranks (dp_shard 2 x cp 2, dp_shard 2 x tp 2) logs the
losses and evaluation of 2 data-parallel ranks; expert parallelism from our own flag (`--parallelism_config_ep_size`)
and YAML key (`parallelism_config_ep_size`) trains a tiny Qwen3-MoE on 4 ranks like one process. What the launcher
decides is its own (`--dry_run`); the runs are pooled (`launch_pooled`)."""

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import cli_cmd, cli_env, explain, launch_pooled

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data"
SCRIPT = REPO / "examples" / "run_clm.py"
ARGS = ["--train_file", DATA / "corpus_train.txt", "--validation_file", DATA / "corpus_validation.txt",
        "--max_eval_samples", "16", "--max_steps", "6", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3", "--do_train", "--do_eval",
        "--logging_steps", "1", "--report_to", "none", "--seed", "3", "--save_strategy", "no"]
ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 4
num_machines: 1
use_cpu: true
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
parallelism_config:
  parallelism_config_dp_shard_size: 2
  parallelism_config_cp_size: 2
  parallelism_config_cp_comm_strategy: allgather
"""


def _launch(home: Path, out: Path, *flags: object) -> subprocess.CompletedProcess:
    return launch_pooled(home, *flags, SCRIPT, "--output_dir", out, *ARGS, cwd=REPO)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_cp")
    home = root / "home"
    _launch(home, root / "dp2", "--cpu", "--num_processes", 2)
    _launch(home, root / "flags", "--cpu", "--num_processes", 4, "--use_parallelism_config",
            "--parallelism_config_cp_size", 2)
    config = root / "accelerate.yaml"
    config.write_text(textwrap.dedent(ACCELERATE_YAML))
    _launch(home, root / "yaml", "--config_file", config)
    _launch(home, root / "tp", "--cpu", "--num_processes", 4, "--use_parallelism_config",
            "--parallelism_config_tp_size", 2)
    return root


def _losses(run: Path) -> list[float]:
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


@pytest.mark.parametrize("how", ["flags", "yaml", "tp"])
def test_cp_and_tp_launch_equal_data_parallel_run(runs, how):
    ref, got = _losses(runs / "dp2"), _losses(runs / how)
    assert len(ref) == 6 and len(set(ref)) == 6
    assert got == pytest.approx(ref, abs=1e-5, rel=0)
    ref_eval = json.loads((runs / "dp2" / "eval_results.json").read_text())
    got_eval = json.loads((runs / how / "eval_results.json").read_text())
    assert got_eval["eval_samples"] == ref_eval["eval_samples"] == 16
    assert got_eval["eval_loss"] == pytest.approx(ref_eval["eval_loss"], abs=1e-5)
    assert got_eval["eval_accuracy"] == pytest.approx(ref_eval["eval_accuracy"], abs=1e-9)
    args = json.loads((runs / how / "training_args.json").read_text())
    size = "tp_size" if how == "tp" else "cp_size"
    assert args[size] == 2 and args["parallel_sizes"][size] == 2


def test_cp_size_not_dividing_the_processes_is_refused_before_start(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([str(c) for c in cli_cmd("launch", "--cpu", "--num_processes", 4, "--use_parallelism_config",
                                                   "--parallelism_config_cp_size", 3, SCRIPT, "--output_dir", out,
                                                   *ARGS)],
                          env=cli_env(tmp_path / "home"), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert "cp_size x tp_size = 3 x 1 = 3 does not divide the 4 ranks" in proc.stderr
    assert not out.exists()  # no rank started


EP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 4
num_machines: 1
use_cpu: true
fsdp_config:
  fsdp_version: 2
parallelism_config:
  parallelism_config_ep_size: 4
"""
WORKER = REPO / "tests" / "distributed" / "workers" / "train_run.py"


def _moe_job(out: Path, **extra: object) -> str:
    return json.dumps([{"model": "qwen3_moe", "weights": True, "out": str(out), **extra}])


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """Expert parallelism from our launch flag and from the YAML key (Accelerate has neither)."""
    from launch import python

    root = tmp_path_factory.mktemp("launch_ep")
    home = root / "home"
    python(WORKER, _moe_job(root / "ref", per_device_train_batch_size=8))
    launch_pooled(home, "--cpu", "--num_processes", 4, "--use_parallelism_config", "--parallelism_config_ep_size", 2,
                  WORKER, _moe_job(root / "flag", per_device_train_batch_size=2), cwd=REPO)
    config = root / "ep.yaml"
    config.write_text(EP_YAML)
    launch_pooled(home, "--config_file", config, WORKER, _moe_job(root / "yaml", per_device_train_batch_size=2),
                  cwd=REPO)
    return root


@pytest.mark.parametrize("how, ep", [("flag", 2), ("yaml", 4)])
def test_ep_launch_equals_one_process(ep_runs, how, ep):
    from launch import assert_same_training

    assert_same_training(ep_runs, "ref", how, tol=1e-5, weight_tol=1e-4)
    from launch import run_result

    assert f"dp_shard 4 x cp 1 x tp 1 x ep {ep} = 4 ranks" in run_result(ep_runs, how)["layout"]
