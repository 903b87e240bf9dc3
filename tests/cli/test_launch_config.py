"""`shardtrain launch` decisions without starting processes: YAML mapping, flags, errors, torchrun arguments.

    /work/main/.venv/bin/python -m pytest tests/cli/test_launch_config.py -q

Errors must name the key and the fix, exit 2, and start nothing (the script's marker file never appears).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import SCRIPTS, explain, run_cli

from shardtrain.cli.main import main

REPORT = SCRIPTS / "report.py"


def dry_run(capsys, *args: str) -> tuple[dict, str]:
    """`shardtrain launch --dry_run ARGS` in this process: (plan, stderr)."""
    capsys.readouterr()
    code = main(["launch", "--dry_run", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


BAD_CONFIGS = {
    "malformed": ("num_processes: [2\n", "malformed YAML"),
    "not_a_mapping": ("- num_processes\n", "top level must be a mapping"),
    "unknown_key": ("num_proceses: 2\n", "did you mean 'num_processes'"),
    "unknown_fsdp_key": (
        "fsdp_config:\n  fsdp_reshard_after_foward: true\n",
        "did you mean 'reshard_after_forward'",
    ),
    "zero_processes": ("num_processes: 0\n", "'num_processes' is 0"),
    "fsdp_version_1": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n", "FSDP1 is not supported"),
    "rank_too_big": (
        "num_machines: 2\nmachine_rank: 2\nmain_process_ip: 10.0.0.1\nnum_processes: 2\n",
        "machine_rank 2 must be below num_machines 2",
    ),
    "not_divisible": ("num_machines: 2\nnum_processes: 3\nmain_process_ip: 10.0.0.1\n", "divisible"),
    "no_main_ip": ("num_machines: 2\nnum_processes: 2\n", "main_process_ip is not set"),
    "fp8": ("mixed_precision: fp8\n", "'mixed_precision' is 'fp8'"),
    "deepspeed": ("distributed_type: DEEPSPEED\n", "does not run"),
    "tpu": ("distributed_type: XLA\n", "the TPU path runs as one plain `python` process per host"),
    "bad_strategy": ("fsdp_config:\n  fsdp_sharding_strategy: 7\n", "1 (full_shard) .. 5"),
    "bad_parallelism_key": (
        "parallelism_config:\n  parallelism_config_cp_sise: 2\n",
        "did you mean 'cp_size'",
    ),
    "cp_not_dividing": (
        "num_processes: 2\nparallelism_config:\n  parallelism_config_cp_size: 3\n",
        "cp_size x tp_size = 3 x 1 = 3 does not divide the 2 ranks",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_refused_before_anything_starts(name, home, tmp_path, capsys) -> None:
    text, message = BAD_CONFIGS[name]
    config, out = write(tmp_path / "bad.yaml", text), tmp_path / "out"
    capsys.readouterr()
    assert main(["launch", "--config_file", str(config), str(REPORT), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num_processes", "0"], "--num_processes: key 'num_processes' is 0"),
        (
            ["--num_machines", "2", "--machine_rank", "3", "--main_process_ip", "h", "--num_processes", "2"],
            "machine_rank 3 must be below",
        ),
        (["--mixed_precision", "fp32"], "use one of bf16, fp16, no"),
        (["--main_process_port", "70000"], "TCP port"),
        (["--fsdp", "full_shard sideways"], "--fsdp: TrainingArguments.fsdp got unknown option 'sideways'"),
        (["--fsdp_config", "{not json"], "--fsdp_config: not valid JSON"),
        (["--fsdp_config", "missing.json"], "neither inline JSON nor an existing JSON file"),
        (["--fsdp_config", '{"version": 1}'], "FSDP1 is not supported"),
        (["--parallelism_config_cp_size", "0"], "parallelism_config_cp_size"),
    ],
)
def test_bad_flags_are_refused(flags, message, home, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["launch", *flags, str(REPORT), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not out.exists()


def test_missing_script_and_missing_config_file(home, tmp_path, capsys) -> None:
    assert main(["launch", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: script") and "nope.py' does not exist" in err
    assert main(["launch", "--config_file", str(tmp_path / "nope.yaml"), str(REPORT)]) == 2
    err = capsys.readouterr().err
    assert "nope.yaml' does not exist" in err and "shardtrain config" in err


def test_errors_from_a_real_process_exit_2_without_traceback(home, tmp_path) -> None:
    config, out = (
        write(tmp_path / "bad.yaml", "num_processes: 2\nfsdp_config:\n  fsdp_version: 1\n"),
        tmp_path / "o",
    )
    proc = run_cli("launch", "--config_file", config, REPORT, out, home=home)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.startswith("error: ")
    assert "FSDP1 is not supported" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_accelerate_fsdp1_spellings_and_parallelism_section(home, tmp_path, capsys) -> None:
    config = write(
        tmp_path / "acc.yaml",
        """\
        distributed_type: FSDP
        num_processes: 4
        mixed_precision: no
        fsdp_config:
          fsdp_reshard_after_forward: SHARD_GRAD_OP
          fsdp_auto_wrap_policy: SIZE_BASED_WRAP
          fsdp_min_num_params: 2000
          fsdp_activation_checkpointing: true
          fsdp_version: 2
        parallelism_config:
          parallelism_config_dp_shard_size: 2
          parallelism_config_cp_size: 2
        """,
    )
    plan, err = dry_run(capsys, "--config_file", str(config), str(REPORT))
    fsdp = json.loads(plan["env"]["SHARDTRAIN_FSDP_CONFIG"])
    assert (fsdp["sharding_strategy"], fsdp["reshard_after_forward"]) == ("shard_grad_op", False)
    assert (fsdp["auto_wrap_policy"], fsdp["min_num_params"], fsdp["activation_checkpointing"]) == (
        "SIZE_BASED_WRAP",
        2000,
        True,
    )
    assert plan["env"]["SHARDTRAIN_MIXED_PRECISION"] == "no"  # YAML's bare `no` is False
    # a non-empty parallelism_config turns it on; the sizes travel as one JSON variable
    assert json.loads(plan["env"]["SHARDTRAIN_PARALLELISM"]) == {"dp_shard_size": 2, "cp_size": 2}
    assert "ignoring keys" not in err


def test_fsdp_flag_forms(home, tmp_path, capsys) -> None:
    assert main(["config", "--default", "--fsdp", "no", "--num_processes", "2"]) == 0
    plan, _ = dry_run(capsys, str(REPORT))
    assert "SHARDTRAIN_USE_FSDP" not in plan["env"] and "SHARDTRAIN_USE_FSDP" in plan["unset"]
    plan, _ = dry_run(
        capsys, "--fsdp", str(REPORT), "--fsdp", "no_shard"
    )  # bare flag; the script's own --fsdp
    assert plan["env"]["SHARDTRAIN_USE_FSDP"] == "1"
    assert plan["torchrun_argv"][-3:] == [str(REPORT), "--fsdp", "no_shard"]
    plan, _ = dry_run(capsys, "--fsdp", "shard_grad_op offload", str(REPORT))
    fsdp = json.loads(plan["env"]["SHARDTRAIN_FSDP_CONFIG"])
    assert (fsdp["reshard_after_forward"], fsdp["cpu_offload"]) == (False, True)
    plan, _ = dry_run(
        capsys, "--fsdp", "full shard", "--fsdp_config", '{"fsdp_offload_params": true}', str(REPORT)
    )
    fsdp = json.loads(plan["env"]["SHARDTRAIN_FSDP_CONFIG"])
    assert (fsdp["sharding_strategy"], fsdp["cpu_offload"]) == ("full_shard", True)
    plan, err = dry_run(capsys, "--fsdp_config", '{"cpu_offload": true}', "--fsdp", "false", str(REPORT))
    assert "SHARDTRAIN_FSDP_CONFIG" not in plan["env"]
    assert "does not use: fsdp_config (FSDP is off: distributed_type MULTI_CPU)" in err


def test_torchrun_arguments(home, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan, err = dry_run(capsys, str(REPORT), "a", "--b")
    assert "no config file found" in err
    _, err = dry_run(capsys, "--cpu", "--num_processes", "2", str(REPORT))
    assert "no config file found" not in err  # the flags say what the file would have (the README's demo)
    assert plan["env"]["OMP_NUM_THREADS"] == "1"
    assert plan["torchrun_argv"] == [
        "--nnodes=1",
        "--nproc_per_node=1",
        "--max_restarts=0",
        str(REPORT),
        "a",
        "--b",
    ]
    common = ["--num_machines", "2", "--num_processes", "8", "--main_process_ip", "10.1.2.3"]
    plan, _ = dry_run(capsys, *common, "--machine_rank", "1", "--max_restarts", "2", str(REPORT))
    assert plan["torchrun_argv"][:-1] == [
        "--nnodes=2",
        "--nproc_per_node=4",
        "--max_restarts=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.1.2.3:29500",
        "--rdzv_id=shardtrain-29500",
        "--rdzv_conf=is_host=0",
    ]
    plan, _ = dry_run(
        capsys,
        *common,
        "--machine_rank",
        "1",
        "--rdzv_backend",
        "static",
        "--main_process_port",
        "1234",
        str(REPORT),
    )
    assert plan["torchrun_argv"][3:-1] == [
        "--rdzv_backend=static",
        "--master_addr=10.1.2.3",
        "--master_port=1234",
        "--node_rank=1",
    ]
    plan, _ = dry_run(capsys, "--main_process_port", "4321", str(REPORT))
    assert plan["torchrun_argv"][3:-1] == [
        "--rdzv_backend=static",
        "--master_addr=127.0.0.1",
        "--master_port=4321",
    ]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plan["env"]
    # Restarts: c10d with a fresh worker store per attempt (pytorch/pytorch#135712).
    plan, _ = dry_run(
        capsys, "--main_process_port", "4321", "--max_restarts", "1", "--rdzv_backend", "static", str(REPORT)
    )
    assert plan["torchrun_argv"][3:-1] == [
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:4321",
        "--rdzv_id=shardtrain-4321",
        "--local_addr=127.0.0.1",
    ]
    assert plan["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_accelerate_yaml_with_null_keys_is_accepted(home, tmp_path, capsys) -> None:
    """Accelerate writes unset keys as null (its latest FSDP config has fsdp_ignored_modules: null)."""
    config = write(
        tmp_path / "latest_fsdp.yaml",
        """\
        compute_environment: LOCAL_MACHINE
        debug: false
        distributed_type: FSDP
        downcast_bf16: 'no'
        enable_cpu_affinity: null
        fsdp_config:
          fsdp_activation_checkpointing: false
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_cpu_ram_efficient_loading: true
          fsdp_ignored_modules: null
          fsdp_offload_params: false
          fsdp_reshard_after_forward: true
          fsdp_state_dict_type: SHARDED_STATE_DICT
          fsdp_transformer_layer_cls_to_wrap: null
          fsdp_version: 2
        machine_rank: 0
        main_process_ip: null
        main_process_port: null
        main_training_function: main
        mixed_precision: bf16
        num_machines: 1
        num_processes: 2
        rdzv_backend: static
        same_network: true
        some_future_key: null
        tpu_env: []
        use_cpu: false
        """,
    )
    plan, err = dry_run(capsys, "--config_file", str(config), str(REPORT))
    fsdp = json.loads(plan["env"]["SHARDTRAIN_FSDP_CONFIG"])
    assert fsdp["state_dict_type"] == "SHARDED_STATE_DICT" and fsdp["cpu_ram_efficient_loading"] is True
    assert fsdp["transformer_layer_cls_to_wrap"] == []  # null: the model's _no_split_modules
    assert plan["env"]["SHARDTRAIN_MIXED_PRECISION"] == "bf16"
    assert "--nproc_per_node=2" in plan["torchrun_argv"]
    assert "some_future_key" in err  # named among the ignored keys, not an error


def test_default_config_warning_names_the_flags_given(home, tmp_path, capsys) -> None:
    _, err = dry_run(capsys, "--mixed_precision", "bf16", str(REPORT))
    assert "settings not given as flags take their defaults" in err and "using defaults: 1 process" not in err
    _, err = dry_run(capsys, "--num_processes", "2", str(REPORT))
    assert "no config file found" not in err  # the number of processes given: nothing is left to guess
