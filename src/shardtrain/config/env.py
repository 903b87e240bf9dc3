"""The environment variables `shardtrain launch` hands to the ranks, and how their values are read.

One source of truth for the launcher (which writes them) and `TrainingArguments` / the process-group
set-up (which read them). A true/false variable accepts only the words below; anything else is an error
naming the variable, so `SHARDTRAIN_CPU=False` means "not CPU", not "set, hence CPU".
"""

from __future__ import annotations

import os

from shardtrain.config import values
from shardtrain.errors import LAUNCHED as LAUNCHED  # "1" under `shardtrain launch` (errors.py writes the reply)
from shardtrain.errors import EnvError

USE_FSDP = "SHARDTRAIN_USE_FSDP"  # true: FSDP on
FSDP_CONFIG = "SHARDTRAIN_FSDP_CONFIG"  # JSON of the validated FSDPConfig.to_dict()
MIXED_PRECISION = "SHARDTRAIN_MIXED_PRECISION"  # no | bf16 | fp16
PARALLELISM = "SHARDTRAIN_PARALLELISM"  # JSON: the parallel sizes (config/parallelism.py)
CPU = "SHARDTRAIN_CPU"  # true: CPU + gloo even when GPUs are visible
FAULT = "SHARDTRAIN_FAULT"  # tests only: "<point>:<rank>:<step>" SIGKILLs that rank there
EXIT_TIMEOUT = "SHARDTRAIN_EXIT_TIMEOUT"  # seconds a finished rank waits at exit for its peers (default 60)
CPU_ALLOCATOR = "SHARDTRAIN_CPU_ALLOCATOR"  # tuned (default) | default: glibc malloc settings on CPU runs
VERIFY = "SHARDTRAIN_VERIFY"  # JSON set by `shardtrain verify`: cap the run and dump its figures (train/verify.py)
GLOO_REDUCE_SCATTER = "SHARDTRAIN_GLOO_REDUCE_SCATTER"  # all_to_all (default) | native: FSDP2's gradient reduction

# torchrun's (`torch.distributed.run`) variables in every worker, read once into the run description (RunSpec)
WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE = "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # > 0 after a restart (--max_restarts)

TRUE_WORDS = values.TRUE_WORDS
FALSE_WORDS = ("", *values.FALSE_WORDS)  # set but empty: false


def env_flag(name: str, default: bool = False) -> bool:
    """The true/false value of environment variable `name` (`default` when unset).

    Raises:
        EnvError: the value is not one of TRUE_WORDS / FALSE_WORDS (case-insensitive).
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise EnvError(f"environment variable {name}={raw!r} is not a true/false word; use one of "
                   f"{list(TRUE_WORDS)} or {list(FALSE_WORDS[1:])}, or unset it")


def true_word(value: bool) -> str:
    """How the launcher writes a true/false variable."""
    return "1" if value else "0"
