"""Process-group set-up and teardown shared by the trainer, tests and examples.

One code path for every case: under `torchrun` / `shardtrain launch` the group comes from the
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); a plain `python script.py` gets a 1-rank group on an
in-memory store, so FSDP2, DTensor and DCP behave the same there.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def device_type() -> str:
    """"cuda" when a GPU is visible (and not disabled with SHARDTRAIN_CPU=1), else "cpu"."""
    if os.environ.get("SHARDTRAIN_CPU", "0") not in ("", "0", "false") or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def backend_for(device: str) -> str:
    """nccl for CUDA, gloo for CPU."""
    return "nccl" if device == "cuda" else "gloo"


def current_device() -> torch.device:
    """This rank's device (cuda:LOCAL_RANK on GPU machines)."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise the default process group once; a no-op when one exists.

    Reads torchrun's environment when present; otherwise makes a 1-rank group.
    """
    if dist.is_initialized():
        return
    device = current_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device.type)
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """Barrier that works on gloo and nccl alike (nccl needs the device)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def destroy_distributed() -> None:
    """Barrier, then destroy the group: ranks leave together, so no peer sees a closed socket."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def find_free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
