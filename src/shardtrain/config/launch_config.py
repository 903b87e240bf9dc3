"""Launch configuration: the YAML that `shardtrain config` writes and `shardtrain launch` reads.

Print the resolved form of a file (default: `$SHARDTRAIN_HOME/default_config.yaml`):

    python -m shardtrain.config.launch_config [PATH]

Schema. shardtrain reads Accelerate's `accelerate config` YAML and writes a subset of it (so Accelerate can
read our files too). Top-level keys that are mapped:

    compute_environment: LOCAL_MACHINE          # the only one supported
    distributed_type: FSDP                      # FSDP -> FSDP on; NO / MULTI_CPU / MULTI_GPU / ... -> off
    mixed_precision: 'no'                       # no | bf16 | fp16
    use_cpu: false                              # true -> SHARDTRAIN_CPU=1 (CPU + gloo even with GPUs)
    num_processes: 2                            # TOTAL over all machines (as in Accelerate)
    num_machines: 1
    machine_rank: 0                             # 0 .. num_machines-1
    main_process_ip: null                       # required when num_machines > 1
    main_process_port: null                     # null: a free port (1 machine) / 29500 (several)
    rdzv_backend: c10d                          # static|c10d|etcd|etcd-v2; unset: c10d for several machines
    max_restarts: 0                             # shardtrain only: torchrun restarts of the worker group
    fsdp_config: {fsdp_version: 2, ...}         # FSDPConfig keys, `fsdp_` prefix optional (fsdp_config.py)
    use_parallelism_config: false               # shardtrain only; a non-empty parallelism_config turns it on
    parallelism_config: {parallelism_config_cp_size: 2}   # sizes: see shardtrain/config/parallelism.py

Accelerate keys that have no meaning here (`debug`, `downcast_bf16`, `tpu_env`, FSDP1 knobs such as
`fsdp_backward_prefetch_policy`, `parallelism_config_cp_backend`, ...) are accepted and named in one
warning line. Any other key is an error that suggests the closest valid key. `fsdp_version: 1` is refused.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shardtrain.config import values
from shardtrain.config.fsdp_config import IGNORED_FSDP1_KEYS, MIXED_PRECISIONS, SHARDING_STRATEGIES, FSDPConfig
from shardtrain.config.parallelism import read_parallelism
from shardtrain.config.values import closest
from shardtrain.errors import FSDPConfigError, LaunchConfigError, ParallelDimsError, ParallelismError

HOME_ENV = "SHARDTRAIN_HOME"
CONFIG_NAME = "default_config.yaml"
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
DEFAULT_MULTI_NODE_PORT = 29500
NON_FSDP_TYPES = frozenset(
    "NO MULTI_CPU MULTI_GPU MULTI_NPU MULTI_XPU MULTI_MLU MULTI_SDAA MULTI_MUSA MULTI_HPU".split()
)
UNSUPPORTED_TYPES = frozenset({"DEEPSPEED", "MEGATRON_LM", "XLA", "TPU"})

_TOP_KEYS = tuple(
    "compute_environment distributed_type mixed_precision use_cpu num_processes num_machines machine_rank "
    "main_process_ip main_process_port rdzv_backend max_restarts fsdp_config use_parallelism_config "
    "parallelism_config".split()
)
# Accelerate keys read and ignored (named in one warning line).
_IGNORED_TOP = frozenset(
    "debug downcast_bf16 main_training_function same_network gpu_ids enable_cpu_affinity dynamo_config "
    "dynamo_backend deepspeed_config megatron_lm_config mpirun_config fp8_config ipex_config use_ipex "
    "tpu_name tpu_zone tpu_use_cluster tpu_use_sudo tpu_vm tpu_env command_file commands fp16".split()
)


def shardtrain_home() -> Path:
    """`$SHARDTRAIN_HOME`, default `~/.cache/shardtrain`."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "shardtrain").expanduser()


def default_config_path() -> Path:
    """Where `shardtrain config` writes and `shardtrain launch` reads by default."""
    return shardtrain_home() / CONFIG_NAME


def _closest(name: str, candidates: list[str]) -> str:
    return closest(name, candidates)


def as_bool(key: str, value: Any, where: str) -> bool:
    """Read a YAML/flag boolean (true/false/yes/no/1/0)."""
    return values.as_bool(f"{where}: key {key!r}", value, LaunchConfigError)


def as_int(key: str, value: Any, where: str, minimum: int, fix: str) -> int:
    """Read an int >= `minimum`; `fix` tells the user what to set instead."""
    return values.as_int(f"{where}: key {key!r}", value, minimum, fix, LaunchConfigError)


def _as_choice(key: str, value: Any, where: str, choices: tuple[str, ...] | frozenset[str]) -> str:
    text = str(value).strip()
    for choice in choices:
        if text.lower() == choice.lower():
            return choice
    raise LaunchConfigError(f"{where}: key {key!r} is {value!r}; use one of {', '.join(sorted(choices))}")


_INT_KEYS = {  # key -> (minimum, fix)
    "num_processes": (1, "set it to the total number of processes over all machines (>= 1)"),
    "num_machines": (1, "set it to the number of machines (>= 1)"),
    "machine_rank": (0, "set it to this machine's rank, 0 .. num_machines-1"),
    "max_restarts": (0, "set it to an int >= 0"),
    "main_process_port": (1, "set a TCP port between 1 and 65535"),
}


def map_fsdp_config(raw: Any, where: str) -> tuple[dict[str, Any], list[str]]:
    """Accelerate's/our `fsdp_config` section -> (FSDPConfig key-space dict, keys ignored)."""
    if raw is None:
        return {}, []
    if not isinstance(raw, dict):
        raise LaunchConfigError(f"{where}: key 'fsdp_config' must be a mapping of FSDP settings, got {raw!r}")
    mapped: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in raw.items():
        if value is None:  # Accelerate writes unset keys as null (e.g. fsdp_ignored_modules): nothing to map
            continue
        name = str(key).removeprefix("fsdp_")
        if name in IGNORED_FSDP1_KEYS:
            ignored.append(f"fsdp_config.{key}")
        elif name == "reshard_after_forward" and str(value).lower() in SHARDING_STRATEGIES:
            mapped["sharding_strategy"] = value  # Accelerate's FSDP1 form: reshard_after_forward: FULL_SHARD
        else:
            mapped[name] = value
    return mapped, ignored


def validate_fsdp(fsdp: dict[str, Any], where: str) -> FSDPConfig:
    """`FSDPConfig.load`, with errors naming the file or flag they came from."""
    try:
        return FSDPConfig.load(dict(fsdp))
    except FSDPConfigError as err:
        raise LaunchConfigError(f"{where}: fsdp_config: {err}") from err


@dataclass
class LaunchConfig:
    """Resolved launch settings (see the module docstring for the YAML keys).

    `fsdp_config` is in FSDPConfig key space (no `fsdp_` prefix); `parallelism` holds the sizes set in
    `parallelism_config` (SIZE_KEYS names); `ignored` lists the keys that were read but have no effect.
    """

    compute_environment: str = "LOCAL_MACHINE"
    distributed_type: str = "FSDP"
    mixed_precision: str = "no"
    use_cpu: bool = False
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str | None = None
    max_restarts: int = 0
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    use_parallelism_config: bool = False
    parallelism: dict[str, int] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    @property
    def use_fsdp(self) -> bool:
        """True when distributed_type is FSDP."""
        return self.distributed_type == "FSDP"

    @property
    def nproc_per_node(self) -> int:
        """Processes started on this machine (num_processes is the total)."""
        return self.num_processes // self.num_machines

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> LaunchConfig:
        """Map a YAML mapping (ours or Accelerate's) key by key; `where` names the source in errors.

        Raises:
            LaunchConfigError: unknown key (with the closest valid one) or a value of the wrong type.
        """
        config = cls()
        known = sorted(set(_TOP_KEYS) | _IGNORED_TOP)
        for key, value in raw.items():
            if key in _IGNORED_TOP:
                config.ignored.append(str(key))
            elif key in _TOP_KEYS:
                config.set(str(key), value, where)
            elif value is None:  # an Accelerate key left unset (null): nothing to do, say so
                config.ignored.append(str(key))
            else:
                raise LaunchConfigError(f"{where}: unknown key {key!r}{_closest(str(key), known)}")
        if "use_parallelism_config" not in raw:  # as Accelerate: a non-empty section turns it on
            config.use_parallelism_config = bool(raw.get("parallelism_config"))
        return config

    def set(self, key: str, value: Any, where: str) -> None:
        """Set one top-level key from YAML or a flag, converting and checking its value.

        Raises:
            LaunchConfigError: wrong type or value, naming `where` and the key.
        """
        if key in _INT_KEYS:
            minimum, fix = _INT_KEYS[key]
            optional = value is None and key == "main_process_port"
            number = None if optional else as_int(key, value, where, minimum, fix)
            if key == "main_process_port" and number is not None and number > 65535:
                raise LaunchConfigError(f"{where}: key {key!r} is {number}; {fix}")
            setattr(self, key, number)
        elif key == "main_process_ip":
            self.main_process_ip = None if value in (None, "") else str(value)
        elif key in ("use_cpu", "use_parallelism_config"):
            setattr(self, key, as_bool(key, value, where))
        elif key == "mixed_precision":  # YAML reads a bare `no` as False
            value = "no" if value in (False, None) else value
            self.mixed_precision = _as_choice(key, value, where, MIXED_PRECISIONS)
        elif key == "rdzv_backend":
            self.rdzv_backend = None if value is None else _as_choice(key, value, where, RDZV_BACKENDS)
        elif key == "compute_environment":
            self.compute_environment = _as_choice(key, value, where, ("LOCAL_MACHINE",))
        elif key == "distributed_type":
            if str(value).strip().upper() in UNSUPPORTED_TYPES:
                tpu = str(value).strip().upper() in ("XLA", "TPU")
                raise LaunchConfigError(
                    f"{where}: key 'distributed_type' is {value!r}, which shardtrain launch does not run; "
                    + ("the TPU path runs as one plain `python` process per host with TrainingArguments "
                       "fsdp_config {'xla': true, 'xla_fsdp_v2': true} (see docs/tpu.md)" if tpu else
                       "use FSDP (with fsdp_config) or MULTI_CPU/MULTI_GPU"))
            self.distributed_type = _as_choice(key, value, where, NON_FSDP_TYPES | {"FSDP"})
        elif key == "fsdp_config":
            self.fsdp_config, ignored = map_fsdp_config(value, where)
            self.ignored += ignored
        elif key == "parallelism_config":
            self._set_parallelism(value or {}, where)
        else:
            raise LaunchConfigError(f"{where}: unknown key {key!r}{_closest(key, list(_TOP_KEYS))}")

    def _set_parallelism(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise LaunchConfigError(f"{where}: key 'parallelism_config' must be a mapping, got {value!r}")
        try:
            sizes, ignored = read_parallelism(value, f"{where}: parallelism_config")
        except ParallelismError as err:
            raise LaunchConfigError(str(err)) from err
        self.parallelism.update(sizes)
        self.ignored += [name.split(": ", 1)[-1] for name in ignored]

    def validate(self, where: str, check_sizes: Callable[..., Any] | None = None) -> FSDPConfig | None:
        """Check the settings together; return the validated FSDPConfig when FSDP is on.

        `check_sizes` (the CLI passes `ParallelDims.resolve`) checks the parallelism sizes against the processes;
        the config layer does not import the parallel layer.

        Raises:
            LaunchConfigError: impossible combinations (rank >= machines, processes not divisible, ...).
        """
        machines, procs = self.num_machines, self.num_processes
        if self.machine_rank >= machines:
            raise LaunchConfigError(f"{where}: machine_rank {self.machine_rank} must be below num_machines "
                                    f"{machines}; machine ranks are 0 .. {machines - 1}")
        if procs % machines:
            raise LaunchConfigError(f"{where}: num_processes {procs} is the total over all machines and "
                                    f"must be divisible by num_machines {machines}; e.g. num_processes: "
                                    f"{machines * max(1, procs // machines)}")
        if machines > 1 and not self.main_process_ip:
            raise LaunchConfigError(f"{where}: num_machines is {machines} but main_process_ip is not set; "
                                    f"set it to the address of the machine with machine_rank 0")
        fsdp = validate_fsdp(self.fsdp_config, where) if (self.fsdp_config or self.use_fsdp) else None
        if check_sizes is not None and (self.use_parallelism_config or fsdp is not None):  # the layer above
            sizes = {k.removesuffix("_size"): v for k, v in self.parallelism.items()} \
                if self.use_parallelism_config else {}  # passes ParallelDims.resolve
            try:
                check_sizes(world_size=procs, fsdp_config=fsdp, local_world_size=self.nproc_per_node, **sizes)
            except ParallelDimsError as err:
                raise LaunchConfigError(f"{where}: num_processes {procs}: {err}") from err
        return fsdp if self.use_fsdp else None

    def to_yaml_dict(self) -> dict[str, Any]:
        """The mapping `shardtrain config` writes (Accelerate's key names, so Accelerate reads it too)."""
        data: dict[str, Any] = {k: getattr(self, k) for k in _TOP_KEYS[:10] if k != "rdzv_backend"}
        if self.rdzv_backend:
            data["rdzv_backend"] = self.rdzv_backend
        if self.max_restarts:
            data["max_restarts"] = self.max_restarts
        fsdp: dict[str, Any] = {}
        for key, value in (self.fsdp_config.items() if self.use_fsdp else ()):
            if key == "transformer_layer_cls_to_wrap" and isinstance(value, list):
                value = ",".join(value)
            fsdp["fsdp_" + {"cpu_offload": "offload_params"}.get(key, key)] = value
        data["fsdp_config"] = fsdp
        if self.use_parallelism_config:
            data["use_parallelism_config"] = True
            data["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in self.parallelism.items()}
        return data


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML config file into a mapping (an empty file gives {}).

    Raises:
        LaunchConfigError: missing file, malformed YAML, or a top level that is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise LaunchConfigError(f"config file {str(path)!r} does not exist; run `shardtrain config` or pass "
                                f"--config_file PATH")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise LaunchConfigError(f"{path}: malformed YAML ({' '.join(str(err).split())}); fix the file or "
                                f"rewrite it with `shardtrain config`") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{path}: the top level must be a mapping of keys (e.g. `num_processes: 2`), "
                                f"got {type(data).__name__}")
    return data


def load_launch_config(path: str | os.PathLike | None = None) -> tuple[LaunchConfig, Path | None]:
    """Load `path`, else the default file when it exists, else the built-in defaults.

    Returns:
        (config, the file it came from or None).
    """
    if path is None:
        path = default_config_path()
        if not path.is_file():
            return LaunchConfig(), None
    return LaunchConfig.from_dict(read_yaml(path), str(path)), Path(path)


def write_launch_config(config: LaunchConfig, path: str | os.PathLike) -> Path:
    """Write `config` as YAML atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(config.to_yaml_dict(), sort_keys=False))
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    try:
        cfg, src = load_launch_config(sys.argv[1] if len(sys.argv) > 1 else None)
        resolved = cfg.validate(str(src or "defaults"))
    except LaunchConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    out = {"source": str(src), **dataclasses.asdict(cfg)}
    out["resolved_fsdp_config"] = resolved.to_dict() if resolved else None
    print(yaml.safe_dump(out, sort_keys=False), end="")
