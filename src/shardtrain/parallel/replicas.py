"""Replica groups on torchft: a lost machine stops its group, not the job.

Each replica group is one job of the usual kind (FSDP2 and any layout inside, its own `torchrun`); the groups
form the outermost data-parallel dimension through torchft. Every step, a lighthouse forms a quorum of the groups
that are up; the groups of the quorum sum their gradients (after FSDP's reduce-scatter inside each group) and
commit the step together, or not at all. A group that starts late or restarts heals from a healthy peer's live
state (`parallel.recovery`: JSON and safetensors, never pickle) before its first step.

    settings = FaultTolerance.resolve(args.fault_tolerance)            # None: no replica groups
    replicas = ReplicaGroups.start(settings, device=device, state=(state_dict_fn, load_state_dict_fn), ...)
    healed = replicas.begin(step)          # before the step's batches are read: the quorum (and a recovery)
    targets, groups = replicas.reduce_counts(targets, inputs)
    replicas.reduce_grads(params, extra)   # the sum over the quorum
    if replicas.commit(): optimizer.step() ...

The first quorum of a group's process waits for every group (up to `start_timeout`) unless a running peer is
ahead of it, so groups started together train every step together; each group's rank 0 prints one line when the
quorum's groups change (`_say_change`). torchft's own INFO log is off unless `torchft_log` asks for it.

Exactness: the counts are summed over the quorum before the first forward, so each group's gradients are its
token sums divided by the quorum's target tokens, and their sum is the exact step of the samples of the groups that
took part (3 of 4 groups: the step of those 3 groups' samples).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch
from torch.distributed import ReduceOp

from shardtrain.config.fault_tolerance import FaultTolerance
from shardtrain.errors import ReplicaGroupError

if TYPE_CHECKING:  # torchft is imported when a run has replica groups (the `ft` extra)
    from shardtrain.parallel.recovery import SafeTransport

log = logging.getLogger(__name__)


def layout_signature(**facts: Any) -> float:
    """A number that equal layouts share (a 24-bit hash: exact when summed over a few groups)."""
    digest = hashlib.blake2b(repr(sorted(facts.items())).encode(), digest_size=3).digest()
    return float(int.from_bytes(digest, "little") + 1)


class _NoFlightRecorderLine(logging.Filter):
    """torchft warns at each new quorum that it cannot reset NCCL's flight recorder, also on gloo runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in str(record.getMessage())


def quiet_torchft(level: str = "warn") -> None:
    """torchft's log at `level` (its Rust core reads RUST_LOG once, when torchft is first imported; a RUST_LOG the
    user set wins): INFO there is four lines a step, each with the whole quorum."""
    os.environ.setdefault("RUST_LOG", level)
    python_level = {"error": logging.ERROR, "warn": logging.WARNING, "info": logging.INFO}.get(level, logging.DEBUG)
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(python_level)
    logging.getLogger("torchft.manager").addFilter(_NoFlightRecorderLine())


def probe_lighthouse(address: str, within: float = 5.0) -> None:
    """Raise OSError unless something accepts a TCP connection at the lighthouse's address within `within`
    seconds (one started at the same time gets them): torchft's own timeouts would report it after a minute."""
    url = urlsplit(address)
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection((url.hostname, url.port or 80), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise OSError(f"nothing accepts connections there after {within:g} s") from None
            time.sleep(0.2)


class ReplicaGroups:
    """This group's place among the replica groups: torchft's `Manager` with the safe transport, as the step
    uses it (see the module docstring). Built by `start`; `close` at the end of the run."""

    def __init__(self, settings: FaultTolerance, manager: Any, transport: SafeTransport, *, rank: int,
                 signature: float, device: torch.device, store: Any = None) -> None:
        self.settings, self.manager, self.transport = settings, manager, transport
        self._store = store  # a group of one process not launched by torchrun: its own store, kept alive here
        self.rank, self.signature, self.device = rank, signature, device
        self.groups: tuple[int, ...] = ()  # the groups of the last quorum's counts
        self.healed = False  # set by the state loader while a quorum heals this group
        self.quorum_seconds = 0.0  # time spent forming quorums (and recovering), for the goodput figures
        self._open = False  # a quorum was formed for the step and not yet committed
        self._joined = False  # a first quorum was formed (the start wait is over)
        self._seen: set[int] = set()  # the groups that have been in a quorum with this one
        self._heal_seconds = 0.0  # what this group's last quorum took when it healed in it (0: it did not)

    @classmethod
    def start(cls, settings: FaultTolerance, *, device: torch.device, signature: float,
              state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None], step: int) -> ReplicaGroups:
        """Join the job's replica groups: torchft's `Manager` for this rank (its group's ranks share its manager
        server), the recovery server, the step count a resume starts from."""
        quiet_torchft(settings.torchft_log)
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from shardtrain.parallel.recovery import SafeTransport, advertised_host

        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        store = None
        if "MASTER_ADDR" not in os.environ:  # one process, not launched: this group's store is its own
            store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        port = settings.recovery_port + local_rank if settings.recovery_port else 0
        timeout = timedelta(seconds=settings.timeout)
        transport = SafeTransport(settings.recovery_host or advertised_host(), port, timeout)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        try:
            probe_lighthouse(settings.lighthouse)
            manager = Manager(
                pg=pg, load_state_dict=None, state_dict=None, min_replica_size=settings.min_replicas,
                use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=settings.quorum_timeout),
                connect_timeout=timeout, rank=rank, world_size=world,
                store_addr="127.0.0.1" if store is not None else None,
                store_port=store.port if store is not None else None,
                lighthouse_addr=settings.lighthouse, replica_id=f"group{settings.replica_group:05d}",
                hostname=settings.recovery_host or socket.gethostname(), checkpoint_transport=transport,
                init_sync=False)
        except Exception as err:
            transport.shutdown()
            raise ReplicaGroupError(f"replica group {settings.replica_group}: cannot reach the lighthouse at "
                                    f"{settings.lighthouse} ({_short(err)}); start it first (`shardtrain "
                                    "lighthouse`) and check the address") from None
        replicas = cls(settings, manager, transport, rank=rank, signature=signature, device=device, store=store)

        def load(received: Any) -> None:
            load_state_dict(received)
            replicas.healed = True

        manager.register_state_dict_fn("trainer", load, state_dict)
        manager.load_state_dict({"step": step, "batches_committed": 0})
        return replicas

    @property
    def group(self) -> int:
        return self.settings.replica_group

    @property
    def is_open(self) -> bool:
        """A quorum was formed for the step about to run and has not committed or failed yet."""
        return self._open

    @property
    def writes(self) -> bool:
        """Whether this group writes the job's files for the last committed step (checkpoints, the record): the
        lowest group of its quorum."""
        return bool(self.groups) and self.groups[0] == self.group

    def begin(self, step: int) -> bool:
        """The quorum of the step about to run (once until it commits or fails); a group behind its peers loads
        a peer's state here. Returns whether it did (the data position moved).

        This process's first quorum, unless it heals from a peer that is ahead (the job is running), waits up to
        start_timeout for every group: groups started together train every step together, and `min_replicas`
        governs only later steps.

        Raises:
            ReplicaGroupError: no quorum within quorum_timeout (the lighthouse unreachable, fewer than
                min_replicas groups up), or a recovery refused.
        """
        if self._open:
            return False
        self.healed = False
        started = time.perf_counter()
        waiting = not self._joined and self.settings.start_timeout > 0
        while True:
            self._quorum(step)
            if not waiting or self.healed or self.manager.num_participants() >= self.settings.replica_groups:
                break
            if time.perf_counter() - started >= self.settings.start_timeout:
                if self.rank == 0:
                    print(f"replica group {self.group}: {self.manager.num_participants()} of "
                          f"{self.settings.replica_groups} groups after start_timeout="
                          f"{self.settings.start_timeout:g}s; starting without the others (they join when up)",
                          flush=True)
                break
            time.sleep(0.5)  # the same quorum again until the others ask too (torchft reconfigures on change only)
        self._joined = True
        self._open = True
        took = time.perf_counter() - started
        self.quorum_seconds += took
        self._heal_seconds = took if self.healed else 0.0
        if self.healed and self.rank == 0:
            print(f"replica group {self.group} recovered step {self.manager.current_step()} from a peer in "
                  f"{took:.2f}s", flush=True)
        return self.healed

    def _quorum(self, step: int) -> None:
        if self.manager.current_step() != step:  # torchft's count of committed steps is the data's steps taken
            self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        try:
            self.manager.start_quorum()
        except ReplicaGroupError:  # a peer's state refused as it was loaded
            raise
        except Exception as err:
            raise ReplicaGroupError(
                f"replica group {self.group}: no quorum at step {step} within {self.settings.quorum_timeout:g}s "
                f"({_short(err)}); is the lighthouse at {self.settings.lighthouse} up, and are at least "
                f"min_replicas={self.settings.min_replicas} groups running?") from None
        failure = self.transport.failure
        if failure is not None and not getattr(failure, "transient", False):
            raise ReplicaGroupError(f"replica group {self.group}: {failure}")
        if failure is not None:  # the step will not commit (torchft saw the error); the next quorum retries
            log.warning("replica group %d: %s; retrying at the next quorum", self.group, failure)

    def reduce_counts(self, targets: int, inputs: int) -> tuple[int, int] | None:
        """The quorum's (target, input) counts from this group's, and which groups they came from; None when the
        reduction failed (a peer died: the step will not commit).

        Raises:
            ReplicaGroupError: a group of the quorum runs another layout.
        """
        count = self.settings.replica_groups
        # the counts, the layout's signature, then per group: whether it takes part, the seconds it spent healing
        header = torch.zeros(3 + 2 * count, dtype=torch.float64, device=self.device)
        header[0], header[1], header[2] = targets, inputs, self.signature
        header[3 + self.group] = 1.0
        header[3 + count + self.group] = self._heal_seconds
        self.manager.allreduce(header, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        values = header.tolist()
        groups = tuple(i for i, flag in enumerate(values[3:3 + count]) if flag > 0.5)
        if values[2] != self.signature * len(groups):
            raise ReplicaGroupError(f"replica group {self.group}: a group of the quorum {list(groups)} runs another "
                                    "layout (world size, parallel sizes, batch sizes, model or steps differ); "
                                    "start every group with the same script, arguments and number of ranks")
        self._say_change(groups, values[3 + count:])
        self.groups = groups
        return round(values[0]), round(values[1])

    def _say_change(self, groups: tuple[int, ...], heal_seconds: list[float]) -> None:
        """One line on every group's rank 0 when the quorum's groups change: the operator's view of the job."""
        if groups == self.groups or self.rank != 0:
            return
        step, before = self.manager.current_step() + 1, self.groups
        if not before:
            print(f"replica groups: step {step} trains with groups {list(groups)} ({len(groups)} of "
                  f"{self.settings.replica_groups})", flush=True)
        share = ("its share of each step is re-fed to later steps" if self.settings.lost_batches == "refeed"
                 else "its share of each step is skipped (lost_batches: skip)")
        for g in sorted(set(before) - set(groups)):
            print(f"replica groups: step {step}: group {g} left ({len(before)} -> {len(groups)} groups); {share}",
                  flush=True)
        for g in sorted(set(groups) - set(before)) if before else ():
            again = "rejoined" if g in self._seen else "joined"
            healed = f"healed from a peer in {heal_seconds[g]:.2f}s" if heal_seconds[g] else "it was at this step"
            print(f"replica groups: step {step}: group {g} {again} ({len(before)} -> {len(groups)} groups); "
                  f"{healed}", flush=True)
        self._seen.update(groups)

    def participants(self) -> tuple[int, ...] | None:
        """The groups of the quorum just formed, in order (one small sum over it); None when it failed."""
        flags = torch.zeros(self.settings.replica_groups, dtype=torch.float64, device=self.device)
        flags[self.group] = 1.0
        self.manager.allreduce(flags, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        return tuple(i for i, flag in enumerate(flags.tolist()) if flag > 0.5)

    def reduce_grads(self, params: list[torch.nn.Parameter], extra: list[torch.Tensor]) -> None:
        """Sum this rank's gradient shards (and `extra` tensors) over the quorum, in place, in one collective."""
        from torch.distributed.tensor import DTensor

        tensors = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params
                   if p.grad is not None] + list(extra)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def commit(self) -> bool:
        """Whether every group of the quorum (and every rank of this group) finished the step: only then may the
        optimizer step. The quorum closes either way."""
        self._open = False
        try:
            return bool(self.manager.should_commit())
        except Exception as err:
            raise ReplicaGroupError(f"replica group {self.group}: the commit of step {self.manager.current_step()} "
                                    f"failed ({_short(err)})") from None

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:200] or type(err).__name__
