"""`shardtrain config`: questionnaire through stdin and a pseudo-terminal, re-runs, --default, bad answers.

    /work/main/.venv/bin/python -m pytest tests/cli/test_config_cmd.py -q
"""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cli_cmd, cli_env, explain, run_cli

from shardtrain.cli.main import main
from shardtrain.config.launch_config import load_launch_config

# compute env, cpu only, machines, processes, precision, fsdp, reshard, offload, wrap, classes, state dict,
# rank-0 loading, activation checkpointing
ANSWERS = [
    "",
    "yes",
    "1",
    "2",
    "bf16",
    "yes",
    "no",
    "yes",
    "",
    "LlamaDecoderLayer",
    "SHARDED_STATE_DICT",
    "yes",
    "no",
]
EXPECTED = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "mixed_precision": "bf16",
    "use_cpu": True,
    "num_processes": 2,
    "num_machines": 1,
    "machine_rank": 0,
    "main_process_ip": None,
    "main_process_port": None,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": False,
        "fsdp_offload_params": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
    },
}


def test_questionnaire_from_stdin_writes_the_yaml(home: Path) -> None:
    proc = run_cli("config", home=home, stdin="\n".join(ANSWERS) + "\n")
    assert proc.returncode == 0, explain(proc)
    path = home / "default_config.yaml"
    assert yaml.safe_load(path.read_text()) == EXPECTED
    config, _ = load_launch_config(path)
    fsdp = config.validate(str(path))
    assert (fsdp.reshard_after_forward, fsdp.cpu_offload, fsdp.transformer_layer_cls_to_wrap) == (
        False,
        True,
        ["LlamaDecoderLayer"],
    )


def feed_stdin(monkeypatch, text: str) -> None:
    """Answers for `input()` in this process, as a pipe would give them (not a terminal)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))


def test_rerun_shows_current_values_as_defaults(home: Path, monkeypatch, capsys) -> None:
    path = home / "default_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(EXPECTED))
    # Change only the process count; then stdin ends, which keeps every other current value (as Enter does).
    feed_stdin(monkeypatch, "\n\n\n4\n")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "Current values from" in out
    for shown in (
        "[yes]",
        "[2]",
        "[bf16]",
        "[LlamaDecoderLayer]",
        "[SHARDED_STATE_DICT]",
        "[TRANSFORMER_BASED_WRAP]",
    ):
        assert shown in out, (shown, out)
    assert "Reshard parameters after forward (less memory)? (yes/no) [no]" in out
    assert yaml.safe_load(path.read_text()) == {**EXPECTED, "num_processes": 4}


def test_bad_piped_answer_is_an_error_and_writes_nothing(home: Path, monkeypatch, capsys) -> None:
    feed_stdin(monkeypatch, "\n\nmany\n")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: answer 'many'") and "num_machines" in err
    assert not (home / "default_config.yaml").exists()


def test_default_and_flags_without_questions(home: Path, capsys) -> None:
    path = home / "default_config.yaml"
    assert main(["config", "--default"]) == 0
    data = yaml.safe_load(path.read_text())
    assert (
        data["distributed_type"] == "FSDP" and data["mixed_precision"] == "no" and data["num_machines"] == 1
    )
    assert (
        data["fsdp_config"]["fsdp_version"] == 2 and data["fsdp_config"]["fsdp_reshard_after_forward"] is True
    )

    # --default ignores the current file; flags answer their questions (several machines here).
    assert (
        main(
            [
                "config",
                "--default",
                "--num_machines",
                "2",
                "--machine_rank",
                "1",
                "--num_processes",
                "4",
                "--main_process_ip",
                "10.0.0.1",
                "--fsdp",
                "no",
                "--mixed_precision",
                "FP16",
            ]
        )
        == 0
    )
    data = yaml.safe_load(path.read_text())
    assert data["distributed_type"] in ("MULTI_CPU", "MULTI_GPU") and data["fsdp_config"] == {}
    assert (data["num_machines"], data["machine_rank"], data["num_processes"]) == (2, 1, 4)
    assert (data["main_process_ip"], data["main_process_port"], data["rdzv_backend"]) == (
        "10.0.0.1",
        29500,
        "c10d",
    )
    assert data["mixed_precision"] == "fp16"

    capsys.readouterr()
    assert main(["config", "--default", "--mixed_precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mixed_precision 'fp32'") and "bf16" in err
    assert (
        main(["config", "--default", "--num_machines", "2", "--num_processes", "3", "--main_process_ip", "h"])
        == 2
    )
    assert "divisible" in capsys.readouterr().err
    assert yaml.safe_load(path.read_text())["mixed_precision"] == "fp16"  # failed runs wrote nothing


def test_questionnaire_on_a_terminal_asks_again_after_a_bad_answer(home: Path) -> None:
    """Drive the questions through a pseudo-terminal, answering each prompt as it appears."""
    answers = ["", "maybe", "yes", "", "2", "fp16", "no"]  # "maybe" is re-asked; FSDP off ends the questions
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cli_cmd("config"),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=cli_env(home),
        cwd=REPO,
        close_fds=True,
    )
    os.close(slave)
    output, sent, deadline = "", 0, time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            if output.rstrip(" ").endswith("]:") and output.count("]: ") > sent and sent < len(answers):
                os.write(master, (answers[sent] + "\n").encode())
                sent += 1
        returncode = proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert returncode == 0, output
    assert "answer yes or no; please answer again." in output
    assert sent == len(answers), output
    data = yaml.safe_load((home / "default_config.yaml").read_text())
    assert (data["use_cpu"], data["num_processes"], data["mixed_precision"]) == (True, 2, "fp16")
    assert data["distributed_type"] == "MULTI_CPU" and data["fsdp_config"] == {}


@pytest.mark.parametrize("answer,written", [("selective", "selective"), ("full", True), ("yes", True),
                                            ("no", False)])
def test_activation_checkpointing_answers(home: Path, answer: str, written: bool | str) -> None:
    """The questionnaire's activation checkpointing takes yes / full, selective or no; the file loads back."""
    path = home / "default_config.yaml"
    assert main(["config", "--default", "--activation_checkpointing", answer]) == 0
    data = yaml.safe_load(path.read_text())
    assert data["fsdp_config"]["fsdp_activation_checkpointing"] == written
    config, _ = load_launch_config(path)
    assert config.validate(str(path)).activation_checkpointing == written


def test_config_takes_the_flag_names_of_launch(home: Path, tmp_path: Path) -> None:
    """`shardtrain launch`'s (Accelerate's) names answer the same questions as config's own names."""
    ours, theirs = tmp_path / "ours.yaml", tmp_path / "theirs.yaml"
    assert main(["config", "--default", "--config_file", str(ours), "--use_cpu", "yes", "--num_processes", "2",
                 "--cpu_offload", "yes", "--state_dict_type", "SHARDED_STATE_DICT",
                 "--cpu_ram_efficient_loading", "yes"]) == 0
    assert main(["config", "--default", "--config_file", str(theirs), "--cpu", "--num_processes", "2",
                 "--fsdp_offload_params", "true", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
                 "--fsdp_cpu_ram_efficient_loading", "true"]) == 0
    written = yaml.safe_load(theirs.read_text())
    assert written == yaml.safe_load(ours.read_text())
    assert written["use_cpu"] is True and written["fsdp_config"]["fsdp_offload_params"] is True
