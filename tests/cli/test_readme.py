"""Every command of the README's "Launch" block, as a reader types it, in a folder holding "Getting started"'s
train.py: `config` (Enter to every question), `plan`, `merge` (of a sharded checkpoint the script wrote, under the
README's name for it), `verify` for real; the `launch` lines (8 processes, GPUs) as `--dry_run`s checked for what
torchrun would get, the Slurm line under a stand-in `srun` that sets a one-node allocation's variables."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launch_pooled
from launch import REPO, worker_env

README = REPO / "README.md"


def readme_commands() -> list[list[str]]:
    """The README's "Launch" block, one argv per line, comments dropped."""
    section = README.read_text().split("## Launch", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def _script() -> str:
    page = (REPO / "docs" / "getting-started.md").read_text()
    script = next(b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if b.startswith("# train.py"))
    sharded = 'max_steps=2, save_steps=2, fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"}'
    return script.replace('"out/first"', '"out"').replace("out/first/final", "out/final").replace(
        "max_steps=40, save_steps=20", sharded)


def _run(argv: list[str], where: Path, env: dict) -> subprocess.CompletedProcess:
    assert argv[0] == "shardtrain", argv
    return subprocess.run([sys.executable, "-m", "shardtrain.cli.main", *argv[1:]], cwd=where, env=env,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("readme")
    (where / "train.py").write_text(_script())
    launch_pooled(where / "home", "--cpu", "--num_processes", "2", "train.py", cwd=where)  # out/checkpoint-2
    (where / "out" / "checkpoint-2").rename(where / "out" / "checkpoint-1000")
    from transformers import LlamaConfig

    # a 4-layer Llama with the real vocabulary: the subject is that the command runs as written (a 1.1B config took
    # ~50 CPU-s to plan here; the planner's own figures are tests/plan's)
    LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4).to_json_file(where / "config.json")
    return where


def test_the_readme_launch_block_is_what_this_test_runs():
    assert [argv[:2] for argv in readme_commands()] == [
        ["shardtrain", "config"], ["shardtrain", "launch"], ["shardtrain", "launch"], ["shardtrain", "plan"],
        ["shardtrain", "merge"], ["shardtrain", "verify"], ["srun", "--ntasks-per-node=1"]]


def test_config_plan_merge_and_verify_run_as_written(folder, tmp_path):
    env = worker_env(SHARDTRAIN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    done = {}
    for argv in readme_commands():
        if argv[1] in ("config", "plan", "merge", "verify"):
            done[argv[1]] = proc = _run(argv, folder, env)
            assert proc.returncode == 0, f"{shlex.join(argv)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "home" / "default_config.yaml").is_file()
    assert "64 ranks" in done["plan"].stdout
    from transformers import LlamaForCausalLM

    assert LlamaForCausalLM.from_pretrained(folder / "out" / "merged").config.num_hidden_layers == 2
    assert "verdict: same run" in done["verify"].stdout + done["verify"].stderr
    assert list((tmp_path / "tmp").glob("shardtrain-verify-*")) == []  # without --keep its runs are removed


def test_the_launch_lines_give_torchrun_what_they_say(folder, tmp_path):
    env = worker_env(SHARDTRAIN_HOME=str(tmp_path / "home"))
    launches = [argv for argv in readme_commands() if argv[:2] == ["shardtrain", "launch"]]
    srun = next(argv for argv in readme_commands() if argv[0] == "srun")
    stand_in = tmp_path / "bin" / "srun"  # a one-node Slurm step: the variables srun sets, then the command
    stand_in.parent.mkdir()
    stand_in.write_text('#!/bin/sh\nexport SLURM_NNODES=1 SLURM_NODEID=0 SLURM_JOB_NODELIST=localhost '
                        'SLURM_JOB_ID=7 SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=1\nshift\nexec "$@"\n')
    stand_in.chmod(0o755)
    env["PATH"] = f"{stand_in.parent}:{Path(sys.executable).parent}:{env['PATH']}"
    plans = []
    for argv in [*launches, srun]:
        at = argv.index("launch") + 1
        dry = [*argv[:at], "--dry_run", *argv[at:]]
        proc = subprocess.run(dry, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{shlex.join(argv)}:\n{proc.stderr[-3000:]}"
        plans.append(json.loads(proc.stdout))
    assert plans[0]["torchrun_argv"][1:] == ["--nproc_per_node=8", "--max_restarts=0", "train.py", "--your_args"]
    assert plans[1]["env"]["SHARDTRAIN_MIXED_PRECISION"] == "bf16" and plans[1]["env"]["SHARDTRAIN_USE_FSDP"] == "1"
    assert json.loads(plans[1]["env"]["SHARDTRAIN_FSDP_CONFIG"])["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert plans[2]["cluster"]["scheduler"] == "slurm" and "--nnodes=1" in plans[2]["torchrun_argv"]


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    from transformers import LlamaConfig

    # a small model: the subject is the closed pipe, not the plan
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).to_json_file(tmp_path / "config.json")
    proc = subprocess.Popen([sys.executable, "-m", "shardtrain.cli.main", "plan", "config.json", "--json"],
                            cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `shardtrain plan ... | head -0`: nobody reads what it prints
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err, err  # as a command SIGPIPE ends
