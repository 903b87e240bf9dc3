"""Fault injection for the crash-safety tests (`SHARDTRAIN_FAULT`), shared by the sync and async save paths."""

from __future__ import annotations

import os
import signal

from shardtrain.config import env
from shardtrain.parallel import collectives


def fault_point(name: str, step: int) -> None:
    """Fault injection for the crash-safety tests: SHARDTRAIN_FAULT="<name>:<rank>:<step>" SIGKILLs that rank
    when it reaches `name` while saving `step`, on the first attempt only (not after a torchrun restart)."""
    if os.environ.get(env.FAULT) == f"{name}:{collectives.get_rank()}:{step}" and \
            os.environ.get(env.RESTART_COUNT, "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
