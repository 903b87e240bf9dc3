"""Parallel sizes as users write them: Hugging Face / Accelerate `parallelism_config`, and how the launcher
hands them to the ranks (one JSON variable, `SHARDTRAIN_PARALLELISM`).

Keys (with or without Accelerate's `parallelism_config_` prefix): `dp_replicate_size`, `dp_shard_size`,
`cp_size`, `tp_size`, `ep_size`, `pp_size` (ints >= 1, unset: decided by `ParallelDims.resolve`), `sp_size`
(Ulysses; only 1), `cp_comm_strategy` (only "allgather": keys and values are gathered over the cp ranks). From an
`accelerate.ParallelismConfig` object, sizes of 1 (its default for every size not given) count as unset.
Accelerate keys with no effect here (`cp_backend`, `sp_backend`, `sp_seq_length`, ...) are accepted and
reported as ignored.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardtrain.config import env
from shardtrain.config.values import as_int, closest
from shardtrain.errors import ParallelismError

SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "ep_size", "pp_size")
CP_COMM_STRATEGIES = ("allgather",)
IGNORED_KEYS = frozenset("cp_backend sp_backend sp_seq_length sp_seq_length_is_variable sp_attn_implementation "
                         "cp_handler sp_handler".split())
PREFIX = "parallelism_config_"


def read_parallelism(value: Any, where: str) -> tuple[dict[str, int], list[str]]:
    """(sizes that are set, ignored keys) from a mapping or an `accelerate.ParallelismConfig`.

    Raises:
        ParallelismError: unknown key (with the closest valid one), a size < 1, sp_size > 1, or a
            cp_comm_strategy other than "allgather".
    """
    if value is None:
        return {}, []
    if not isinstance(value, dict):  # accelerate's ParallelismConfig (a dataclass): read its fields
        if not hasattr(value, "cp_size"):
            raise ParallelismError(f"{where} must be a mapping or accelerate.ParallelismConfig, got {value!r}")
        handler = getattr(value, "cp_handler", None)
        # It fills every size it was not given with 1; a 1 there means "not set" (the rest of the ranks), not
        # "no sharding", or ParallelismConfig(cp_size=2) would fit only 2 ranks.
        value = {**{k: getattr(value, k, None) for k in (*SIZE_KEYS, "sp_size") if getattr(value, k, None) != 1},
                 "cp_comm_strategy": getattr(handler, "cp_comm_strategy", None)}
    sizes: dict[str, int] = {}
    ignored: list[str] = []
    valid = sorted({*SIZE_KEYS, "sp_size", "cp_comm_strategy", *IGNORED_KEYS})
    for key, item in value.items():
        name = str(key).removeprefix(PREFIX)
        if item is None:
            continue
        if name in SIZE_KEYS or name == "sp_size":
            number = as_int(f"{where}.{key}", item, 1, "set it to an int >= 1", ParallelismError)
            if name == "sp_size":
                if number > 1:
                    raise ParallelismError(f"{where}.{key} = {number}: Ulysses sequence parallelism is not "
                                           "implemented; use cp_size (context parallelism) instead")
                continue
            sizes[name] = number
        elif name == "cp_comm_strategy":
            if str(item) not in CP_COMM_STRATEGIES:
                raise ParallelismError(f"{where}.{key} = {item!r}: only 'allgather' (keys and values gathered "
                                       "over the cp ranks) is implemented; set it to 'allgather' or drop it")
        elif name in IGNORED_KEYS:
            ignored.append(f"{where}.{key}")
        else:
            raise ParallelismError(f"{where}: unknown key {key!r}{closest(name, valid)}")
    return sizes, ignored


def to_env(sizes: dict[str, int]) -> str:
    """The value of `SHARDTRAIN_PARALLELISM` for `sizes`."""
    return json.dumps({k: sizes[k] for k in SIZE_KEYS if k in sizes}, sort_keys=True)


def from_env() -> dict[str, int]:
    """The sizes the launcher set (empty when `SHARDTRAIN_PARALLELISM` is unset)."""
    raw = os.environ.get(env.PARALLELISM)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ParallelismError(f"environment variable {env.PARALLELISM}={raw!r} is not JSON ({err}); unset it or "
                               "start the script with shardtrain launch") from err
    return read_parallelism(value, env.PARALLELISM)[0]
