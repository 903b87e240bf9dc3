r"""`shardtrain launch`: run a script on N processes / M machines through torchrun's elastic agent, in-process.

    shardtrain launch train.py --lr 1e-4                      # settings: $SHARDTRAIN_HOME/default_config.yaml
    shardtrain launch --config_file accelerate.yaml train.py  # ours or Accelerate's YAML
    shardtrain launch --num_processes 2 --mixed_precision bf16 --fsdp "full shard" \
        --fsdp_config fsdp.json train.py
    shardtrain launch --num_machines 2 --machine_rank 0 --num_processes 4 \
        --main_process_ip 10.0.0.1 --main_process_port 29500 train.py  # + machine_rank 1 on the other host
    shardtrain launch --dry_run train.py                      # print env + torchrun args, start nothing
    srun --ntasks-per-node=1 shardtrain launch train.py       # Slurm / a PyTorchJob pod: machines, rank and host
                                                              # come from the scheduler (flags still win)

Flags override the file. Everything is validated before a process starts. The script learns its settings
from environment variables (the contract read by `TrainingArguments`):

    SHARDTRAIN_USE_FSDP=1            FSDP on (distributed_type FSDP, --fsdp or --fsdp_config); else unset
    SHARDTRAIN_FSDP_CONFIG={...}     JSON of the validated `FSDPConfig.to_dict()`; unset without FSDP
    SHARDTRAIN_MIXED_PRECISION=no    no | bf16 | fp16
    SHARDTRAIN_PARALLELISM={"cp_size": 2}   only with --use_parallelism_config / a parallelism_config section
    SHARDTRAIN_CPU=1                 with --cpu / use_cpu: true (otherwise left as it is)
    SHARDTRAIN_LAUNCHED=1            a rank that prints its `error:` line tells the launcher (no second line)
    OMP_NUM_THREADS=1                when unset
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from shardtrain.cli.config_cmd import check_parallel_sizes
from shardtrain.config import env as env_names
from shardtrain.config.accelerate_env import FSDP_FLAGS, flag_help, fsdp_from_flags
from shardtrain.config.cluster import apply_cluster, detect_cluster
from shardtrain.config.env import true_word
from shardtrain.config.fsdp_config import parse_fsdp_option
from shardtrain.config.launch_config import DEFAULT_MULTI_NODE_PORT, LaunchConfig, load_launch_config, map_fsdp_config
from shardtrain.config.parallelism import SIZE_KEYS, read_parallelism, to_env
from shardtrain.errors import REPORTED_PREFIX, FSDPConfigError, LaunchConfigError, ParallelismError

ENV_USE_FSDP = env_names.USE_FSDP
ENV_FSDP_CONFIG = env_names.FSDP_CONFIG
ENV_MIXED_PRECISION = env_names.MIXED_PRECISION
ENV_PARALLELISM = env_names.PARALLELISM
ENV_CPU = env_names.CPU

_VALUE_FLAGS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                "rdzv_backend", "mixed_precision", "max_restarts")
_PARALLELISM_FLAGS = tuple(f"parallelism_config_{k}" for k in (*SIZE_KEYS, "cp_comm_strategy"))
_OTHER_VALUE_FLAGS = ("config_file", "fsdp_config", *_PARALLELISM_FLAGS, *FSDP_FLAGS)
_FALSE_WORDS = ("false", "no", "0", "off")


@dataclass
class LaunchPlan:
    """What `launch` will do: the worker environment and torchrun's arguments."""

    config: LaunchConfig
    env: dict[str, str]
    unset: list[str]
    torchrun_argv: list[str]
    warnings: list[str] = field(default_factory=list)
    cluster: dict[str, object] | None = None  # the scheduler and {setting: [value, source]}, when one was read


def add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `launch` and its flags (values are checked by `LaunchConfig.set`, with clear messages)."""
    p = subparsers.add_parser("launch", help="run a training script on several processes / machines",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
    p.add_argument("--config_file", help="YAML config (ours or Accelerate's); default: "
                                         "$SHARDTRAIN_HOME/default_config.yaml")
    p.add_argument("--num_processes", help="total number of processes over all machines")
    p.add_argument("--num_machines", help="number of machines")
    p.add_argument("--machine_rank", help="rank of this machine, 0 .. num_machines-1")
    p.add_argument("--main_process_ip", help="address of the machine with machine_rank 0")
    p.add_argument("--main_process_port", help="port on that machine")
    p.add_argument("--rdzv_backend", help="static | c10d (default for several machines) | etcd | etcd-v2")
    p.add_argument("--mixed_precision", help="no | bf16 | fp16")
    p.add_argument("--fsdp", nargs="?", const="true", metavar="OPTIONS",
                   help='turn FSDP on ("true", or legacy strings like "full shard", "shard_grad_op '
                        'offload"); "false" turns it off')
    p.add_argument("--fsdp_config", help="FSDP settings: path of a JSON file or inline JSON; replaces the "
                                         "config file's fsdp_config and turns FSDP on")
    p.add_argument("--max_restarts", help="restarts of the worker group after a failure (default 0)")
    # Accelerate's FSDP flags, with its names and values (shardtrain.config.accelerate_env)
    p.add_argument("--use_fsdp", action="store_true", help="FSDP on (Accelerate's name for --fsdp)")
    for flag in FSDP_FLAGS:
        p.add_argument(f"--{flag}", help=flag_help(flag))
    p.add_argument("--use_parallelism_config", action="store_true",
                   help="use the parallelism sizes (flags below, or the config file's parallelism_config)")
    for flag in _PARALLELISM_FLAGS:
        p.add_argument(f"--{flag}", help=f"{flag.removeprefix('parallelism_config_')} (--use_parallelism_config)")
    p.add_argument("--cpu", action="store_true", help="train on CPU (gloo) even when GPUs are visible")
    p.add_argument("--replica_group_id", type=int, help="replica groups (fault_tolerance): this job's group id")
    p.add_argument("--num_replica_groups", type=int, help="replica groups: how many groups the job has")
    p.add_argument("--lighthouse", help="replica groups: the lighthouse's address, http://HOST:PORT")
    p.add_argument("--dry_run", action="store_true", help="print the plan as JSON and start nothing")
    p.add_argument("script", help="training script (.py)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run_launch)


def normalize_fsdp_flag(argv: list[str]) -> list[str]:
    """Make a bare `--fsdp` directly before the script (or another flag) mean `--fsdp=true`.

    Only launch's own flags (those before the script) are looked at; the script's arguments are left alone.
    """
    out, i = list(argv), 0
    while i < len(out):
        token = out[i]
        if token == "--fsdp":
            nxt = out[i + 1] if i + 1 < len(out) else None
            bare = nxt is None or nxt.startswith("-") or nxt.endswith(".py")
            if bare:
                out[i] = "--fsdp=true"
            i += 1 if bare else 2
        elif token.startswith("--") and token[2:] in (*_VALUE_FLAGS, *_OTHER_VALUE_FLAGS):
            i += 2
        elif token.startswith("-"):
            i += 1
        else:
            break
    return out


def _read_fsdp_json(text: str) -> dict:
    where = "--fsdp_config"
    if text.lstrip().startswith("{"):
        source = text
    else:
        path = Path(text)
        if not path.is_file():
            raise LaunchConfigError(f"{where}: {text!r} is neither inline JSON nor an existing JSON file")
        source, where = path.read_text(), f"--fsdp_config {text}"
    try:
        data = json.loads(source)
    except json.JSONDecodeError as err:
        raise LaunchConfigError(f"{where}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{where}: expected a JSON object of settings, not {type(data).__name__}")
    return data


def _apply_flags(config: LaunchConfig, args: argparse.Namespace, warnings: list[str]) -> None:
    for name in _VALUE_FLAGS:
        if getattr(args, name) is not None:
            config.set(name, getattr(args, name), f"--{name}")
    if args.cpu:
        config.use_cpu = True
    if args.fsdp_config is not None:
        config.fsdp_config, ignored = map_fsdp_config(_read_fsdp_json(args.fsdp_config), "--fsdp_config")
        config.ignored += ignored
        config.distributed_type = "FSDP"
    if args.fsdp is not None and args.fsdp.strip().lower() in _FALSE_WORDS:
        config.distributed_type = "NO" if config.num_processes == 1 else "MULTI_CPU"
    elif args.fsdp is not None:
        try:
            _, overrides = parse_fsdp_option(args.fsdp)
        except FSDPConfigError as err:
            raise LaunchConfigError(f"--fsdp: {err}") from err
        config.distributed_type = "FSDP"
        if "sharding_strategy" in overrides and args.fsdp_config is None:
            config.fsdp_config.pop("reshard_after_forward", None)  # the flag beats the file
        config.fsdp_config.update(overrides)
    given = {flag: getattr(args, flag) for flag in FSDP_FLAGS if getattr(args, flag) is not None}
    if args.use_fsdp or given:
        settings, ignored = fsdp_from_flags(given)
        config.fsdp_config.update(settings)
        config.ignored += ignored
        config.distributed_type = "FSDP"
    if args.use_parallelism_config:
        config.use_parallelism_config = True
    given = {flag: getattr(args, flag) for flag in _PARALLELISM_FLAGS if getattr(args, flag) is not None}
    if given:
        try:
            sizes, _ = read_parallelism(given, "flag")
        except ParallelismError as err:
            raise LaunchConfigError(str(err).replace("flag.", "--")) from err
        if config.use_parallelism_config:
            config.parallelism.update(sizes)
        else:
            names = " ".join(f"--{flag} {value}" for flag, value in given.items())
            warnings.append(f"{names} ignored: the parallelism config is off (no --use_parallelism_config, no "
                            f"parallelism_config in the config file); every size stays at its default")


def uses_fresh_worker_store(config: LaunchConfig) -> bool:
    """Restarts with c10d: give each attempt its own worker store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).

    The store torchrun shares with the workers outlives an attempt, so a restarted rank can read the
    address a killed rank wrote and wait on a dead peer (pytorch/pytorch#135712).
    """
    c10d = config.num_machines == 1 or (config.rdzv_backend or "c10d") == "c10d"  # one machine: always c10d
    return config.max_restarts > 0 and c10d


def torchrun_argv(config: LaunchConfig, script: str, script_args: list[str]) -> list[str]:
    """torchrun (`torch.distributed.run`) arguments for `config`.

    One machine: static rendezvous on main_process_ip (default 127.0.0.1):main_process_port, or a port that
    torchrun picks when none is set; with restarts, c10d (see `uses_fresh_worker_store`). Several machines:
    c10d rendezvous on main_process_ip:main_process_port (machine 0 hosts it), or `rdzv_backend: static`.
    """
    argv = [f"--nnodes={config.num_machines}", f"--nproc_per_node={config.nproc_per_node}",
            f"--max_restarts={config.max_restarts}"]
    ip, port = config.main_process_ip, config.main_process_port
    if config.num_machines == 1:
        host = ip or "127.0.0.1"
        if config.max_restarts > 0:
            argv += ["--rdzv_backend=c10d", f"--rdzv_endpoint={host}:{port or 0}",
                     f"--rdzv_id=shardtrain-{port or 'local'}", f"--local_addr={host}"]
        elif port is not None:
            argv += ["--rdzv_backend=static", f"--master_addr={host}", f"--master_port={port}"]
    else:
        backend, port = config.rdzv_backend or "c10d", port or DEFAULT_MULTI_NODE_PORT
        if backend == "static":
            argv += ["--rdzv_backend=static", f"--master_addr={ip}", f"--master_port={port}",
                     f"--node_rank={config.machine_rank}"]
        else:
            argv += [f"--rdzv_backend={backend}", f"--rdzv_endpoint={ip}:{port}",
                     f"--rdzv_id=shardtrain-{port}"]
            if backend == "c10d":
                argv.append(f"--rdzv_conf=is_host={int(config.machine_rank == 0)}")
    return [*argv, script, *script_args]


def build_plan(args: argparse.Namespace) -> LaunchPlan:
    """Load the config, apply the flags, validate everything, and compute env + torchrun arguments.

    Raises:
        LaunchConfigError: anything that would make the launch fail; nothing has been started.
    """
    warnings: list[str] = []
    config, source = load_launch_config(args.config_file)
    file_config = copy.deepcopy(config) if source is not None else None
    _apply_flags(config, args, warnings)
    cluster_plan = _read_cluster(config, args, file_config, warnings)
    if source is None and args.num_processes is None and cluster_plan is None:  # flags or a scheduler answer it
        warnings.insert(0, "no config file found (run `shardtrain config`); settings not given as flags take "
                           "their defaults (1 process, FSDP on)")
    if config.fsdp_config and not config.use_fsdp:
        config.ignored.append(f"fsdp_config (FSDP is off: distributed_type {config.distributed_type})")
    if config.ignored:
        names = ", ".join(config.ignored)
        warnings.append(f"{source or 'flags'}: ignoring keys shardtrain does not use: {names}")
    fsdp = config.validate(f"{source or 'defaults'} + flags", check_sizes=check_parallel_sizes)
    if not Path(args.script).is_file():
        raise LaunchConfigError(f"script {args.script!r} does not exist (looked from {os.getcwd()}); "
                                f"pass the path of your training script")
    env = {ENV_MIXED_PRECISION: config.mixed_precision, env_names.LAUNCHED: "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    unset = []
    if fsdp is not None:
        env.update({ENV_USE_FSDP: true_word(True), ENV_FSDP_CONFIG: json.dumps(fsdp.to_dict(), sort_keys=True)})
    else:
        unset += [ENV_USE_FSDP, ENV_FSDP_CONFIG]
    if config.use_parallelism_config:
        env[ENV_PARALLELISM] = to_env(config.parallelism)
    else:
        unset.append(ENV_PARALLELISM)
    if config.use_cpu:
        env[ENV_CPU] = true_word(True)
    if uses_fresh_worker_store(config):
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = torchrun_argv(config, args.script, list(args.script_args))
    env.update(_replica_env(args))
    return LaunchPlan(config, env, unset, argv, warnings, cluster_plan)


def _replica_env(args: argparse.Namespace) -> dict[str, str]:
    """The replica-group flags as the variables `fault_tolerance` reads (all three, or none)."""
    from shardtrain.config import fault_tolerance as ft

    given = {ft.GROUP_ENV: args.replica_group_id, ft.GROUPS_ENV: args.num_replica_groups,
             ft.LIGHTHOUSE_ENV: args.lighthouse}
    if all(value is None for value in given.values()):
        return {}
    if any(value is None for value in given.values()):
        raise LaunchConfigError("replica groups need --replica_group_id, --num_replica_groups and --lighthouse "
                                "together (one job per group; see docs/fault-tolerance.md)")
    settings = {"replica_group": args.replica_group_id, "replica_groups": args.num_replica_groups,
                "lighthouse": args.lighthouse}
    try:
        ft.FaultTolerance.resolve(settings, {})
    except Exception as err:
        message = str(err).replace("fault_tolerance replica_groups=", "--num_replica_groups ")
        message = message.replace("fault_tolerance replica_group=", "--replica_group_id ")
        raise LaunchConfigError(message.replace("fault_tolerance lighthouse=", "--lighthouse ")) from None
    return {name: str(value) for name, value in given.items()}


def _local_devices(use_cpu: bool) -> int:
    """Processes per machine when the scheduler does not say: one per visible GPU, one on CPU."""
    if use_cpu:
        return 1
    import torch

    return max(torch.cuda.device_count(), 1)


def _read_cluster(config: LaunchConfig, args: argparse.Namespace, file_config: LaunchConfig | None,
                  warnings: list[str]) -> dict[str, object] | None:
    """Slurm / PyTorchJob settings where no flag gave them (`shardtrain.config.cluster`)."""
    cluster = detect_cluster(os.environ)
    if cluster is None:
        return None
    flags = {name for name in _VALUE_FLAGS if getattr(args, name) is not None}
    if cluster.no_gpus and not config.use_cpu:  # SLURM_GPUS_ON_NODE=0: a CPU node, as --cpu says
        config.use_cpu = True
        warnings.append("SLURM_GPUS_ON_NODE=0: no GPU on this node for the job; running CPU processes (gloo), "
                        "as with --cpu")
    resolved, notes = apply_cluster(config, cluster, flags=flags, file_config=file_config,
                                    local_devices=partial(_local_devices, config.use_cpu))
    warnings += notes
    return {"scheduler": cluster.scheduler, "settings": resolved}


def _said_by_launch(record: logging.LogRecord) -> bool:
    """Drop the agent's per-worker lines on a failed run; `execute` says the same in one `error:` line."""
    return not str(record.msg).startswith(("Sending process", "failed (exitcode"))


def execute(plan: LaunchPlan) -> int:
    """Run torchrun's elastic agent in this process; 0 when every worker succeeded, 1 when one failed,
    128 + signal number (130 SIGINT, 143 SIGTERM) when the launcher was stopped by a signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    for name in plan.unset:
        os.environ.pop(name, None)
    os.environ.update(plan.env)
    torchrun_args = get_args_parser().parse_args(plan.torchrun_argv)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_said_by_launch)
    try:
        run(torchrun_args)
    except ChildFailedError as err:
        if any(str(failure.message).startswith(REPORTED_PREFIX) for failure in err.failures.values()):
            return 1  # a rank printed the `error:` line already
        codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
        print(f"error: {torchrun_args.training_script} failed (exit codes by global rank: {codes}); see the "
              f"output above", file=sys.stderr)
        return 1
    except SignalException as err:  # the agent has already stopped the workers
        signum = int(err.sigval)
        print(f"error: stopped by {signal.Signals(signum).name}; the workers were terminated", file=sys.stderr)
        return 128 + signum
    except KeyboardInterrupt:
        print("error: stopped by SIGINT; the workers were terminated", file=sys.stderr)
        return 130
    except RendezvousError as err:
        print(f"error: rendezvous failed ({type(err).__name__}: {err}); check --main_process_ip/port and "
              f"that every machine was started", file=sys.stderr)
        return 1
    return 0


def run_launch(args: argparse.Namespace) -> int:
    """Entry of `shardtrain launch` (a LaunchConfigError raised here becomes `error: ...`, exit 2)."""
    plan = build_plan(args)
    for line in plan.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if args.dry_run:
        plan_json = {"env": plan.env, "unset": plan.unset, "torchrun_argv": plan.torchrun_argv,
                     "cluster": plan.cluster}
        print(json.dumps(plan_json, indent=2))
        return 0
    return execute(plan)
