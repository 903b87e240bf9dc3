"""`shardtrain env`: versions, distributed backends, devices and the resolved default config (bug reports).

shardtrain env
python -m shardtrain.cli.main env
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata

import yaml

from shardtrain.cli.config_cmd import check_parallel_sizes
from shardtrain.config.launch_config import default_config_path, load_launch_config
from shardtrain.errors import LaunchConfigError


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def collect_env() -> dict[str, object]:
    """Everything `shardtrain env` prints, as a dict."""
    import torch
    import torch.distributed as dist

    import shardtrain

    info: dict[str, object] = {
        "shardtrain": shardtrain.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "safetensors": _version("safetensors"),
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count(),
        "cpu_count": os.cpu_count(),
        "config_file": str(default_config_path()),
    }
    try:
        config, source = load_launch_config()
        fsdp = config.validate(str(source or "defaults"), check_sizes=check_parallel_sizes)
        info["config"] = {
            "source": str(source) if source else "none (built-in defaults; run `shardtrain config`)",
            **config.to_yaml_dict(),
            "resolved_fsdp_config": fsdp.to_dict() if fsdp else None,
        }
        if config.ignored:
            info["config"]["ignored_keys"] = config.ignored
    except LaunchConfigError as err:
        info["config"] = f"invalid: {err}"
    return info


def run_env(args: argparse.Namespace) -> int:
    """Entry of `shardtrain env`."""
    print(yaml.safe_dump(collect_env(), sort_keys=False, width=110), end="")
    return 0


def add_env_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `env`."""
    p = subparsers.add_parser(
        "env", help="print versions, backends, devices and the resolved default config", allow_abbrev=False
    )
    p.set_defaults(func=run_env)
