"""What a cluster scheduler already knows about a job, read once for `shardtrain launch`.

    cluster = detect_cluster(os.environ)     # None outside Slurm, a Kubeflow PyTorchJob or a TorchElastic pod
    cluster.num_machines, cluster.machine_rank, cluster.host, cluster.port, cluster.procs_per_machine
    expand_nodelist("gpu[01-03,07],login")   # ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login']

Slurm (one `shardtrain launch` per node: `srun --ntasks-per-node=1 shardtrain launch train.py`):
    SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST (its first host is the rendezvous host, expanded by
    `scontrol show hostnames` when present, else parsed here), SLURM_GPUS_ON_NODE; the port from MASTER_PORT.
Kubeflow PyTorchJob / TorchElastic (one launcher per pod):
    PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR/PET_MASTER_PORT or PET_RDZV_ENDPOINT (set when
    the job has `nprocPerNode` or an elastic policy); otherwise the pod-level WORLD_SIZE, RANK, MASTER_ADDR and
    MASTER_PORT that a PyTorchJob sets (WORLD_SIZE counts pods there, not processes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from shardtrain.config.launch_config import LaunchConfig
from shardtrain.errors import LaunchConfigError


@dataclass(frozen=True, kw_only=True)
class ClusterEnv:
    """The job's shape as the scheduler states it; `sources` names the variable behind each setting."""

    scheduler: str
    num_machines: int
    machine_rank: int
    host: str
    port: int | None = None
    procs_per_machine: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    # the node has no GPU for this job (SLURM_GPUS_ON_NODE=0): CPU processes unless the flags say otherwise
    no_gpus: bool = False
    # why the scheduler's process count cannot be read; raised only where no flag gives the count
    procs_problem: str | None = None


def _int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise LaunchConfigError(f"environment variable {name}={raw!r} is not a whole number >= {minimum}; "
                                f"fix the job's environment or pass the matching `shardtrain launch` flag")
    return value


def _split_top_level(text: str) -> list[str]:
    """Split at commas that are not inside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise LaunchConfigError(f"Slurm node list {nodelist!r}: cannot read the range [{spec}]; pass "
                                    f"--main_process_ip with the first node's address")
        width = len(lo)  # Slurm keeps the zero padding of the lower bound: 01-10 -> 01 .. 10
        out += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list as host names, in order: 'node[01-02,07],gpu-a[1-2]x' -> node01, node02, ...

    Raises:
        LaunchConfigError: a bracket that does not close or a range that is not numbers.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        match = re.search(r"\[([^\[\]]*)\]", part)
        if match is None:
            if "[" in part or "]" in part:
                raise LaunchConfigError(f"Slurm node list {nodelist!r}: unbalanced bracket in {part!r}; pass "
                                        f"--main_process_ip with the first node's address")
            hosts.append(part)
            continue
        head, tail = part[:match.start()], part[match.end():]
        for middle in _expand_range(match.group(1), nodelist):  # the tail may hold more bracket groups
            hosts += expand_nodelist(head + middle + tail)
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `scontrol show hostnames` when it is on PATH, else `expand_nodelist`."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=30, check=False)
        names = done.stdout.split()
        if done.returncode == 0 and names:
            return names[0]
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise LaunchConfigError(f"Slurm node list {nodelist!r} names no host; pass --main_process_ip")
    return hosts[0]


def _port(environ: Mapping[str, str], *names: str) -> tuple[int | None, str | None]:
    for name in names:
        if environ.get(name, "").strip():
            return _int(environ, name, minimum=1), name
    return None, None


def _slurm(environ: Mapping[str, str]) -> ClusterEnv:
    if "SLURM_STEP_ID" in environ and "SLURM_STEP_NUM_TASKS" in environ and "SLURM_STEP_NUM_NODES" in environ:
        tasks, nodes = _int(environ, "SLURM_STEP_NUM_TASKS", 1), _int(environ, "SLURM_STEP_NUM_NODES", 1)
        if tasks != nodes:
            raise LaunchConfigError(
                f"srun started {tasks} tasks on {nodes} nodes (SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES), but "
                f"`shardtrain launch` starts every process of its node itself; run one launcher per node: "
                f"`srun --ntasks-per-node=1 shardtrain launch ...`")
    list_name = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in environ else "SLURM_NODELIST"
    sources = {"num_machines": "SLURM_NNODES", "machine_rank": "SLURM_NODEID", "host": list_name}
    port, port_name = _port(environ, "MASTER_PORT")
    if port_name:
        sources["port"] = port_name
    procs, problem, no_gpus = None, None, False
    gpus = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if gpus:
        try:
            procs = _int(environ, "SLURM_GPUS_ON_NODE", 0)
        except LaunchConfigError as err:  # a flag may still give the count (`apply_cluster`)
            problem = str(err).replace("flag", "flag (--num_processes)")
        if procs == 0:  # a CPU node: no GPU for this job
            procs, no_gpus = None, True
        elif procs is not None:
            sources["procs_per_machine"] = "SLURM_GPUS_ON_NODE"
    return ClusterEnv(scheduler="slurm", num_machines=_int(environ, "SLURM_NNODES", 1),
                      machine_rank=_int(environ, "SLURM_NODEID"), host=first_host(environ[list_name]),
                      port=port, procs_per_machine=procs, sources=sources, no_gpus=no_gpus, procs_problem=problem)


def _machines(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name].strip()
    low, _, high = raw.partition(":")  # TorchElastic writes "min:max"
    if high and low != high:
        raise LaunchConfigError(f"environment variable {name}={raw!r} is an elastic range; shardtrain launch runs "
                                f"a fixed number of machines: set minReplicas = maxReplicas in the job, or pass "
                                f"--num_machines")
    return _int({name: low}, name, 1)


def _pytorchjob(environ: Mapping[str, str]) -> ClusterEnv:
    sources: dict[str, str] = {}
    if "PET_NNODES" in environ:
        machines, sources["num_machines"] = _machines(environ, "PET_NNODES"), "PET_NNODES"
        rank_name = "PET_NODE_RANK" if "PET_NODE_RANK" in environ else "RANK"
    else:
        machines, sources["num_machines"] = _int(environ, "WORLD_SIZE", 1), "WORLD_SIZE"
        rank_name = "RANK"
    if rank_name not in environ:
        raise LaunchConfigError(f"a PyTorchJob environment with {sources['num_machines']} but no {rank_name}; set "
                                f"this machine's rank, or pass --machine_rank")
    rank, sources["machine_rank"] = _int(environ, rank_name), rank_name
    endpoint = environ.get("PET_RDZV_ENDPOINT", "").strip()
    if endpoint:
        host, _, port_text = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        port = _int({"PET_RDZV_ENDPOINT": port_text}, "PET_RDZV_ENDPOINT", 1) if port_text else None
        sources.update(host="PET_RDZV_ENDPOINT", port="PET_RDZV_ENDPOINT")
    else:
        host_name = "PET_MASTER_ADDR" if environ.get("PET_MASTER_ADDR") else "MASTER_ADDR"
        host, sources["host"] = environ.get(host_name, "").strip(), host_name
        port, port_name = _port(environ, "PET_MASTER_PORT", "MASTER_PORT")
        if port_name:
            sources["port"] = port_name
    if not host:
        raise LaunchConfigError("a PyTorchJob environment without MASTER_ADDR or PET_RDZV_ENDPOINT; set the "
                                "rendezvous host, or pass --main_process_ip")
    procs = None
    if environ.get("PET_NPROC_PER_NODE", "").strip().isdigit():
        procs, sources["procs_per_machine"] = int(environ["PET_NPROC_PER_NODE"]), "PET_NPROC_PER_NODE"
    return ClusterEnv(scheduler="pytorchjob", num_machines=machines, machine_rank=rank, host=host, port=port,
                      procs_per_machine=procs or None, sources=sources)


def detect_cluster(environ: Mapping[str, str]) -> ClusterEnv | None:
    """The scheduler's view of this job, or None when the environment names none.

    A process started by torchrun (LOCAL_RANK or TORCHELASTIC_RUN_ID set) is a worker, not a machine: its
    WORLD_SIZE/RANK count processes, so they are not read as a PyTorchJob's pods.

    Raises:
        LaunchConfigError: a variable that is not a number, an elastic range, an unreadable node list, or a
            Slurm step with several launchers on one node.
    """
    if "SLURM_NNODES" in environ and "SLURM_NODEID" in environ and (
            "SLURM_JOB_NODELIST" in environ or "SLURM_NODELIST" in environ):
        return _slurm(environ)
    worker = "LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ
    if "PET_NNODES" in environ or (not worker and "MASTER_ADDR" in environ and "WORLD_SIZE" in environ):
        return _pytorchjob(environ)
    return None


_TAKEN = (("num_machines", "num_machines"), ("machine_rank", "machine_rank"), ("main_process_ip", "host"),
          ("main_process_port", "port"))


def apply_cluster(config: LaunchConfig, cluster: ClusterEnv, *, flags: set[str], file_config: LaunchConfig | None,
                  local_devices: Callable[[], int]) -> tuple[dict[str, list], list[str]]:
    """Fill `config` from the scheduler where no flag set the value; return {setting: [value, source]} and warnings.

    Order: a flag wins (with a warning when it contradicts the scheduler); a config file's value that differs
    from both the default and the scheduler's is an error naming both; otherwise the scheduler's value.
    `num_processes` (Accelerate's meaning: every process of the job) is the flag's, else a multi-machine file's
    when its machine count is the scheduler's, else machines x processes per machine (the scheduler's count,
    else `local_devices()`, asked only then).

    Raises:
        LaunchConfigError: the config file and the scheduler disagree.
    """
    defaults, resolved, warnings = LaunchConfig(), {}, []
    for key, attr in _TAKEN:
        value, variable = getattr(cluster, attr), cluster.sources.get(attr, cluster.scheduler)
        if value is None:
            continue
        if key in flags:
            resolved[key] = [getattr(config, key), f"--{key}"]
            if getattr(config, key) != value:
                warnings.append(f"--{key} {getattr(config, key)} overrides {variable}={value} ({cluster.scheduler})")
            continue
        in_file = getattr(file_config, key) if file_config is not None else getattr(defaults, key)
        if in_file != getattr(defaults, key) and in_file != value:
            raise LaunchConfigError(f"the config file says {key}: {in_file} but {variable} says {value} "
                                    f"({cluster.scheduler}); remove {key} from the file, or pass --{key} to choose")
        setattr(config, key, value)
        resolved[key] = [value, variable]
    if "num_processes" in flags:
        resolved["num_processes"] = [config.num_processes, "--num_processes"]
    elif file_config is not None and file_config.num_machines == config.num_machines > 1:
        resolved["num_processes"] = [config.num_processes, "config file"]
    else:
        if cluster.procs_problem is not None:
            raise LaunchConfigError(cluster.procs_problem)
        per_machine = cluster.procs_per_machine or local_devices()
        source = cluster.sources.get("procs_per_machine", "devices visible here")
        config.num_processes = per_machine * config.num_machines
        resolved["num_processes"] = [config.num_processes, f"{config.num_machines} machines x {per_machine} "
                                                           f"({source})"]
    return resolved, warnings


def _tasks_on_node(spec: str, node: int) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE ('2(x3),1': 2 tasks on each of 3 nodes, then 1) at node index `node`."""
    counts: list[int] = []
    for part in _split_top_level(spec):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def srun_worker_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for a script that `srun` started once per device (`srun --ntasks-per-node=G python
    train.py`), read from the step's Slurm variables; None outside such a step or when torchrun's are set.

    The rendezvous is the step's first host; its port MASTER_PORT, else 10000 + SLURM_JOB_ID mod 20000 (every
    task of the job computes the same).
    """
    if "RANK" in environ or "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    tasks = _int(environ, "SLURM_STEP_NUM_TASKS", 1)
    if tasks < 2:
        return None
    list_name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if n in environ),
                     None)
    if list_name is None:
        raise LaunchConfigError("an srun step without SLURM_STEP_NODELIST / SLURM_JOB_NODELIST; set MASTER_ADDR, or "
                                "start the script with `srun --ntasks-per-node=1 shardtrain launch`")
    local = _tasks_on_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""), _int(environ, "SLURM_NODEID")) \
        if environ.get("SLURM_STEP_TASKS_PER_NODE") else None
    port = environ.get("MASTER_PORT") or str(10000 + _int(environ, "SLURM_JOB_ID") % 20000)
    return {"RANK": str(_int(environ, "SLURM_PROCID")), "WORLD_SIZE": str(tasks),
            "LOCAL_RANK": str(_int(environ, "SLURM_LOCALID")), "LOCAL_WORLD_SIZE": str(local or 1),
            "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(environ[list_name]), "MASTER_PORT": port}


def adopt_srun_environment() -> None:
    """Under `srun` with a task per device (no torchrun), set torchrun's variables from Slurm's (in this process's
    environment, once), so the rest of the run reads one contract; outside such a step, nothing."""
    adopted = srun_worker_environment(os.environ)
    if adopted is not None:
        os.environ.update(adopted)
