"""`shardtrain env` and the wiring of `shardtrain merge` (the merge itself is tested with its own code).

    /work/main/.venv/bin/python -m pytest tests/cli/test_env_merge.py -q
"""

from __future__ import annotations

import sys

import torch
import yaml

import shardtrain
from shardtrain.cli.main import main


def test_env_prints_versions_backends_and_config(home, capsys) -> None:
    assert main(["env"]) == 0
    info = yaml.safe_load(capsys.readouterr().out)
    assert info["shardtrain"] == shardtrain.__version__ and info["torch"] == torch.__version__
    assert info["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert info["backends"]["gloo"] is True and set(info["backends"]) == {"gloo", "nccl", "mpi"}
    assert info["cuda_device_count"] == torch.cuda.device_count()
    assert info["config"]["source"].startswith("none")
    assert info["config"]["resolved_fsdp_config"]["version"] == 2

    assert main(["config", "--default", "--mixed_precision", "bf16"]) == 0
    capsys.readouterr()
    assert main(["env"]) == 0
    info = yaml.safe_load(capsys.readouterr().out)
    assert info["config"]["source"] == str(home / "default_config.yaml")
    assert info["config"]["mixed_precision"] == "bf16"

    (home / "default_config.yaml").write_text("num_processes: 0\n")
    assert main(["env"]) == 0
    assert "invalid:" in yaml.safe_load(capsys.readouterr().out)["config"]


def test_merge_errors_exit_2_without_traceback(tmp_path, capsys) -> None:
    assert main(["merge", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: checkpoint directory {tmp_path / 'missing'} does not exist\n"
    assert main(["merge", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "holds no model" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_usage_errors_exit_2(capsys) -> None:
    assert main([]) == 2
    assert main(["merge", "only-one"]) == 2
    assert main(["--help"]) == 0
    assert "config" in capsys.readouterr().out
