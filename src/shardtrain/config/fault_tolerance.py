"""The `fault_tolerance` setting (replica groups on torchft), validated once; its launcher variables.

    settings = FaultTolerance.resolve({"replica_group": 0, "replica_groups": 2, "lighthouse": "http://h:29510"})

`shardtrain launch --replica_group_id I --num_replica_groups R --lighthouse ADDR` sets the variables below, which
complete (or stand in for) the `TrainingArguments` field. What the groups do is `parallel.replicas`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardtrain.errors import TrainingArgumentsError

# the launcher's variables (`shardtrain launch --replica_group_id I --num_replica_groups R --lighthouse ADDR`)
GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV = "SHARDTRAIN_REPLICA_GROUP", "SHARDTRAIN_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
# torchft's own log (its Rust core's and Python's): "warn" by default (INFO is four lines a step); info | debug
TORCHFT_LOG_ENV = "SHARDTRAIN_TORCHFT_LOG"
TORCHFT_LOG_LEVELS = ("error", "warn", "info", "debug")
LOST_BATCHES = ("skip", "refeed")
KEYS = {"replica_group": "this group's id, 0 .. replica_groups - 1",
        "replica_groups": "how many groups the job has (its global batch is theirs together)",
        "lighthouse": "the lighthouse's address, http://host:port (`shardtrain lighthouse`)",
        "min_replicas": "the fewest groups that may commit a step (default 1)",
        "timeout": "seconds a collective across the groups or a recovery may take (default 60)",
        "quorum_timeout": "seconds to wait for a quorum of min_replicas groups (default 60)",
        "start_timeout": "seconds the job's first step waits for all replica_groups before min_replicas applies "
                         "(default 300)",
        "recovery_host": "the address this group's recovery server binds and advertises (default: the hostname)",
        "recovery_port": "the first port of this group's recovery servers, one per rank (default 0: any free)",
        "lost_batches": "a dead group's share of a step: skip it (as torchft) or refeed it to a later step",
        "torchft_log": f"torchft's own log level, one of {TORCHFT_LOG_LEVELS} (default warn; or {TORCHFT_LOG_ENV})"}


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """The `fault_tolerance` setting, validated once (see `KEYS` for each field)."""

    replica_group: int
    replica_groups: int
    lighthouse: str
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    start_timeout: float = 300.0
    recovery_host: str = ""
    recovery_port: int = 0
    lost_batches: str = "skip"
    torchft_log: str = "warn"

    @classmethod
    def resolve(cls, value: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
                ) -> FaultTolerance | None:
        """The settings of `TrainingArguments.fault_tolerance` (a dict), completed from the launcher's variables;
        None when neither asks for replica groups.

        Raises:
            TrainingArgumentsError: a key or value that cannot be used, named with the fix.
        """
        environ = os.environ if environ is None else environ
        if value is not None and not isinstance(value, Mapping):
            raise TrainingArgumentsError(f"fault_tolerance={value!r} is not a dict; give it as "
                                         "{'replica_group': I, 'replica_groups': R, 'lighthouse': 'http://HOST:PORT'}"
                                         " (or launch with `shardtrain launch --replica_group_id I "
                                         "--num_replica_groups R --lighthouse http://HOST:PORT`)")
        given = dict(value or {})
        if value is None and GROUP_ENV not in environ:
            return None
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise TrainingArgumentsError(f"fault_tolerance has no key {unknown[0]!r}; its keys are "
                                         f"{', '.join(KEYS)}")
        for key, name in (("replica_group", GROUP_ENV), ("replica_groups", GROUPS_ENV),
                          ("lighthouse", LIGHTHOUSE_ENV), ("torchft_log", TORCHFT_LOG_ENV)):
            if key not in given and environ.get(name):
                given[key] = environ[name]
        for key in ("replica_group", "replica_groups", "lighthouse"):
            if key not in given:
                raise TrainingArgumentsError(f"fault_tolerance needs {key!r} ({KEYS[key]}); set it, or launch with "
                                             "`shardtrain launch --replica_group_id I --num_replica_groups R "
                                             "--lighthouse http://HOST:PORT`")
        settings = cls(**{k: _typed(k, v) for k, v in given.items()})
        settings.check()
        return settings

    def check(self) -> None:
        if self.replica_groups < 1:
            raise TrainingArgumentsError(f"fault_tolerance replica_groups={self.replica_groups}: it must be >= 1")
        if not 0 <= self.replica_group < self.replica_groups:
            raise TrainingArgumentsError(f"fault_tolerance replica_group={self.replica_group} is not one of the "
                                         f"{self.replica_groups} groups (0 .. {self.replica_groups - 1})")
        if not 1 <= self.min_replicas <= self.replica_groups:
            raise TrainingArgumentsError(f"fault_tolerance min_replicas={self.min_replicas}: it must be between 1 "
                                         f"and replica_groups={self.replica_groups}")
        if self.lost_batches not in LOST_BATCHES:
            raise TrainingArgumentsError(f"fault_tolerance lost_batches={self.lost_batches!r} is not supported; "
                                         f"use one of {list(LOST_BATCHES)}")
        if self.torchft_log not in TORCHFT_LOG_LEVELS:
            raise TrainingArgumentsError(f"fault_tolerance torchft_log={self.torchft_log!r} is not a level; use one "
                                         f"of {list(TORCHFT_LOG_LEVELS)} (or unset {TORCHFT_LOG_ENV})")
        if not self.lighthouse.startswith(("http://", "https://")):
            raise TrainingArgumentsError(f"fault_tolerance lighthouse={self.lighthouse!r} is not an address; "
                                         "give it as http://HOST:PORT")
        if not 0 <= self.recovery_port <= 65535:
            raise TrainingArgumentsError(f"fault_tolerance recovery_port={self.recovery_port} is not a port; give "
                                         "one in 1 .. 65535 (local rank r takes the port + r), or 0 for any free one")
        if min(self.timeout, self.quorum_timeout) <= 0:
            raise TrainingArgumentsError("fault_tolerance timeout and quorum_timeout must be positive seconds")
        if self.start_timeout < 0:
            raise TrainingArgumentsError(f"fault_tolerance start_timeout={self.start_timeout:g}: it must be >= 0 "
                                         "seconds (0: the first step starts with the groups already up)")

    def data_split(self, size: int, rank: int) -> tuple[int, int]:
        """(data-parallel size, rank) over all groups, from the group's own: the groups' samples are disjoint
        slices of one global batch."""
        return size * self.replica_groups, self.replica_group * size + rank


def _typed(key: str, value: Any) -> Any:
    kind = FaultTolerance.__dataclass_fields__[key].type
    try:
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise TrainingArgumentsError(f"fault_tolerance {key}={value!r} is not a{'n' if kind == 'int' else ''} "
                                     f"{kind} ({KEYS[key]})") from None
