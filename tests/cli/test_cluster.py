"""`shardtrain launch` inside Slurm and a Kubeflow PyTorchJob: the scheduler's environment read, flags winning,
contradictions refused, and two "machines" on loopback training as one machine with the same world size does;
`srun python train.py` with a task per device (no launcher) as well.

    /work/main/.venv/bin/python -m pytest tests/cli/test_cluster.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SCRIPTS, cli_cmd, cli_env, explain, run_together
from launch import read_json

from shardtrain.cli.main import main
from shardtrain.config.cluster import detect_cluster, expand_nodelist, srun_worker_environment
from shardtrain.errors import LaunchConfigError
from shardtrain.parallel.distributed import find_free_port

REPORT = SCRIPTS / "report.py"
WORKER = REPO / "tests" / "distributed" / "workers" / "train_run.py"
JOB = json.dumps([{"per_device_train_batch_size": 4, "max_steps": 3, "save_strategy": "no", "logging_steps": 1}])

# forms Slurm writes (sinfo/scontrol documentation): ranges keep the lower bound's zero padding
NODELISTS = {
    "node01": ["node01"],
    "node[01-03]": ["node01", "node02", "node03"],
    "node[1,3-4]": ["node1", "node3", "node4"],
    "gpu[001-002],cpu[9-10]": ["gpu001", "gpu002", "cpu9", "cpu10"],
    "rack[1-2]-n[01-02]": ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"],
    "node[08-11]": ["node08", "node09", "node10", "node11"],
    "a-b.example.com,c": ["a-b.example.com", "c"],
    "dgx[7]": ["dgx7"],
}


@pytest.mark.parametrize("nodelist", list(NODELISTS))
def test_slurm_node_lists_expand_as_scontrol_does(nodelist):
    assert expand_nodelist(nodelist) == NODELISTS[nodelist]


@pytest.mark.parametrize("nodelist", ["node[1-", "node[a-b]", "node[3-1]", "node]1["])
def test_an_unreadable_node_list_is_refused_with_the_fix(nodelist):
    with pytest.raises(LaunchConfigError, match="--main_process_ip"):
        expand_nodelist(nodelist)


SLURM = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-10]",
         "SLURM_GPUS_ON_NODE": "8"}
PYTORCHJOB = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1"}


def test_detect_reads_slurm_pytorchjob_and_torchelastic():
    slurm = detect_cluster(SLURM)
    assert (slurm.scheduler, slurm.num_machines, slurm.machine_rank, slurm.host, slurm.port,
            slurm.procs_per_machine) == ("slurm", 4, 2, "gpu07", None, 8)
    job = detect_cluster(PYTORCHJOB)
    assert (job.scheduler, job.num_machines, job.machine_rank, job.host, job.port) == \
        ("pytorchjob", 3, 1, "job-master-0", 23456)
    elastic = detect_cluster({"PET_NNODES": "2:2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4",
                              "PET_RDZV_ENDPOINT": "job-master-0:29400", **PYTORCHJOB})
    assert (elastic.num_machines, elastic.machine_rank, elastic.host, elastic.port, elastic.procs_per_machine) == \
        (2, 1, "job-master-0", 29400, 4)
    assert detect_cluster({**PYTORCHJOB, "LOCAL_RANK": "0"}) is None  # a torchrun worker, not a pod
    assert detect_cluster({}) is None


@pytest.mark.parametrize("environ,message", [
    ({"PET_NNODES": "1:4", "PET_NODE_RANK": "0", "MASTER_ADDR": "m"}, "elastic range"),
    ({**SLURM, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "32", "SLURM_STEP_NUM_NODES": "4"},
     "srun --ntasks-per-node=1"),
    ({**SLURM, "SLURM_NNODES": "four"}, "SLURM_NNODES='four' is not a whole number"),
])
def test_scheduler_mistakes_are_named(environ, message):
    with pytest.raises(LaunchConfigError, match=message):
        detect_cluster(environ)


def _dry_run(capsys, *args: str) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main(["launch", "--dry_run", *args, str(REPORT)])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


def _set(monkeypatch, environ: dict[str, str]) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def test_dry_run_under_slurm_prints_the_resolved_settings_and_their_sources(home, capsys, monkeypatch):
    _set(monkeypatch, {**SLURM, "MASTER_PORT": "29555"})
    code, plan, err = _dry_run(capsys)
    assert code == 0, err
    assert plan["cluster"] == {"scheduler": "slurm", "settings": {
        "num_machines": [4, "SLURM_NNODES"], "machine_rank": [2, "SLURM_NODEID"],
        "main_process_ip": ["gpu07", "SLURM_JOB_NODELIST"], "main_process_port": [29555, "MASTER_PORT"],
        "num_processes": [32, "4 machines x 8 (SLURM_GPUS_ON_NODE)"]}}
    assert plan["torchrun_argv"][:6] == ["--nnodes=4", "--nproc_per_node=8", "--max_restarts=0",
                                         "--rdzv_backend=c10d", "--rdzv_endpoint=gpu07:29555",
                                         "--rdzv_id=shardtrain-29555"]
    assert "--rdzv_conf=is_host=0" in plan["torchrun_argv"]  # machine 2 does not host the rendezvous
    assert "no config file found" not in err


def test_flags_win_over_the_scheduler_with_a_warning(home, capsys, monkeypatch):
    _set(monkeypatch, SLURM)
    code, plan, err = _dry_run(capsys, "--num_machines", "2", "--machine_rank", "1", "--num_processes", "4")
    assert code == 0, err
    assert plan["torchrun_argv"][:2] == ["--nnodes=2", "--nproc_per_node=2"]
    assert "warning: --num_machines 2 overrides SLURM_NNODES=4 (slurm)" in err


def test_a_cpu_node_under_slurm_runs_cpu_processes(home, capsys, monkeypatch):
    """SLURM_GPUS_ON_NODE=0 is a node without GPUs for the job: one CPU process per node (gloo), as --cpu."""
    _set(monkeypatch, {**SLURM, "SLURM_GPUS_ON_NODE": "0"})
    code, plan, err = _dry_run(capsys)
    assert code == 0, err
    assert plan["env"]["SHARDTRAIN_CPU"] == "1"
    assert plan["torchrun_argv"][:2] == ["--nnodes=4", "--nproc_per_node=1"]
    assert "SLURM_GPUS_ON_NODE=0: no GPU on this node" in err
    code, plan, err = _dry_run(capsys, "--cpu", "--num_processes", "8")  # a flag wins over the scheduler
    assert code == 0, err
    assert plan["torchrun_argv"][:2] == ["--nnodes=4", "--nproc_per_node=2"]


def test_a_flag_wins_over_an_unreadable_scheduler_count(home, capsys, monkeypatch):
    _set(monkeypatch, {**SLURM, "SLURM_GPUS_ON_NODE": "gpu:a100:2"})
    code, _, err = _dry_run(capsys)
    assert code == 2
    assert "SLURM_GPUS_ON_NODE='gpu:a100:2' is not a whole number >= 0" in err and "--num_processes" in err
    code, plan, err = _dry_run(capsys, "--num_processes", "8")
    assert code == 0, err
    assert plan["torchrun_argv"][:2] == ["--nnodes=4", "--nproc_per_node=2"]


def test_a_config_file_that_contradicts_the_scheduler_is_one_error_naming_both(home, capsys, monkeypatch,
                                                                                 tmp_path):
    _set(monkeypatch, SLURM)
    config = tmp_path / "cluster.yaml"
    config.write_text("num_machines: 2\nnum_processes: 16\nmain_process_ip: 10.0.0.1\n")
    code, _, err = _dry_run(capsys, "--config_file", str(config))
    assert code == 2
    assert err.strip().splitlines() == ["error: the config file says num_machines: 2 but SLURM_NNODES says 4 "
                                        "(slurm); remove num_machines from the file, or pass --num_machines to "
                                        "choose"]


def _two_machines(home: Path, out: Path, environ_of: dict[int, dict[str, str]], launcher: bool = True) -> dict:
    """Two `shardtrain launch` processes (one per "machine", one rank each), or two plain `python` processes,
    that know only the environment."""
    job = json.dumps([{**json.loads(JOB)[0], "out": str(out)}])
    command = cli_cmd("launch", "--cpu", "--num_processes", 2, WORKER, job) if launcher else \
        [sys.executable, str(WORKER), job]
    run_together([(command, cli_env(home, **environ_of[m])) for m in (0, 1)])
    return read_json(out / "result.json")


@pytest.fixture(scope="module")
def single_machine(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("one_machine") / "out"
    proc = subprocess.run(cli_cmd("launch", "--cpu", "--num_processes", 2, WORKER,
                                  json.dumps([{**json.loads(JOB)[0], "out": str(out)}])),
                          env=cli_env(out.parent / "home"), cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, explain(proc)
    return read_json(out / "result.json")


def test_srun_with_a_task_per_device_gives_torchrun_variables():
    step = {"SLURM_JOB_ID": "123456", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[03-04]"}
    assert srun_worker_environment(step) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                             "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu03", "MASTER_PORT": "13456"}
    assert srun_worker_environment({**step, "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODEID": "2"})[
        "LOCAL_WORLD_SIZE"] == "2"
    assert srun_worker_environment({**step, "RANK": "0"}) is None  # torchrun's own variables win
    assert srun_worker_environment({**step, "SLURM_STEP_NUM_TASKS": "1"}) is None  # one task: nothing to join


@pytest.mark.parametrize("scheduler", ["slurm", "pytorchjob", "srun_python"])
def test_two_machines_from_the_scheduler_train_as_one_machine_does(home, tmp_path, single_machine, scheduler):
    port = str(find_free_port())
    if scheduler == "slurm":  # a bracketed list whose first host is this machine (the loopback name)
        environ_of = {m: {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": str(m), "MASTER_PORT": port,
                          "SLURM_JOB_NODELIST": "localhost,node[02]"} for m in (0, 1)}
    elif scheduler == "pytorchjob":
        environ_of = {m: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(m)}
                      for m in (0, 1)}
    else:  # `srun --ntasks-per-node=2 python train.py`: no launcher, one task per device
        environ_of = {m: {"SLURM_JOB_ID": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": str(m),
                          "SLURM_LOCALID": str(m), "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
                          "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
                          "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port,
                          "SHARDTRAIN_CPU": "1"} for m in (0, 1)}
    result = _two_machines(home, tmp_path / "out", environ_of, launcher=scheduler != "srun_python")
    assert result["layout"] == single_machine["layout"]
    assert len(result["losses"]) == 3
    assert result["losses"] == pytest.approx(single_machine["losses"], abs=1e-6)
    assert result["grad_norms"] == pytest.approx(single_machine["grad_norms"], abs=1e-6)
