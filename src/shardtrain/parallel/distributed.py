"""Process-group set-up and teardown shared by the trainer, tests and examples.

One code path for every case: under `torchrun` / `shardtrain launch` the group comes from the
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); a plain `python script.py` gets a 1-rank group on an
in-memory store, so FSDP2, DTensor and DCP behave the same there.

`init_distributed` also registers an exit handler (see `_teardown_at_exit`): a finished script exits 0
whether or not it calls `destroy_distributed()` (or `dist.destroy_process_group()`) itself. At exit a
rank waits up to SHARDTRAIN_EXIT_TIMEOUT seconds (default 60) for the other ranks to finish their scripts
too; a rank that exits because of an uncaught exception does not wait.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtrain.config import env
from shardtrain.config.cluster import adopt_srun_environment
from shardtrain.parallel.cpu_allocator import tune_cpu_allocator

logger = logging.getLogger(__name__)

EXIT_TIMEOUT_VAR = env.EXIT_TIMEOUT
_DEFAULT_EXIT_TIMEOUT_S = 60.0


def device_type() -> str:
    """"cuda" when a GPU is visible (and not disabled with SHARDTRAIN_CPU=1), else "cpu".

    SHARDTRAIN_CPU takes the true/false words of `shardtrain.config.env` (so `SHARDTRAIN_CPU=False` means GPU).
    """
    if env.env_flag(env.CPU) or not torch.cuda.is_available():
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


@dataclass(frozen=True)
class LaunchedProcesses:
    """What Hugging Face's `TrainingArguments.distributed_state` (Accelerate's `PartialState`) tells libraries
    before any process group exists (TRL reads `distributed_type` while loading a model by name), from the
    launcher's environment; the process group itself is shardtrain's backend's."""

    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device

    @property
    def distributed_type(self) -> str:
        from accelerate.utils import DistributedType

        if self.num_processes <= 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @classmethod
    def from_environment(cls) -> LaunchedProcesses:
        return cls(num_processes=int(os.environ.get("WORLD_SIZE", "1") or 1),
                   process_index=int(os.environ.get("RANK", "0") or 0),
                   local_process_index=int(os.environ.get("LOCAL_RANK", "0") or 0), device=current_device())


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise the default process group once; a no-op when one exists.

    Reads torchrun's environment when present; otherwise makes a 1-rank group. Registers (once per
    process) the exit handler that drains and destroys the groups when the script ends without doing so. On
    CPU, sets glibc's malloc to keep FSDP's buffers (`cpu_allocator.py`; SHARDTRAIN_CPU_ALLOCATOR=default: not).
    """
    _register_exit_handler()
    if dist.is_initialized():
        return
    end_with_launcher()
    adopt_srun_environment()
    global _generation
    _generation += 1
    device = current_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "cpu":
        tune_cpu_allocator()
    backend = backend_for(device.type)
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def end_with_launcher() -> None:
    """Under torchrun (`shardtrain launch`), have Linux SIGKILL this worker when its launcher dies.

    torchrun starts each worker in a session of its own, so a launcher killed alone (SIGKILL, an OOM kill)
    would leave its workers running as orphans: a replica group half alive, still counted by its peers, or
    GPUs held by a job that is gone. A no-op elsewhere (no torchrun, not Linux).
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if parent == 1 or os.getppid() != parent:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def launched_alone() -> bool:
    """Whether this process runs alone: no process group yet and no launcher (torchrun, or srun's variables)
    started others."""
    if dist.is_initialized():
        return False
    adopt_srun_environment()
    return int(os.environ.get("WORLD_SIZE", "1") or 1) == 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """Barrier that works on gloo and nccl alike (nccl needs the device)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def destroy_distributed() -> None:
    """Barrier, then destroy every group: ranks leave together, so no peer sees a closed socket.

    On gloo the barrier also parks the communication still referenced by gloo's worker threads, so that
    nothing is released on those threads at interpreter exit (see `_teardown_at_exit`).
    """
    if dist.is_initialized():
        _drain_and_destroy(timeout=None)


# ---------------------------------------------------------------------------------------------------------
# Clean exit.
#
# Symptom: a finished multi-rank run on gloo sometimes dies at interpreter exit with "terminate called
# without an active exception" (SIGABRT), after training, evaluation and saving finished on every rank.
#
# Mechanism (core dump of an aborted rank: the main thread in Py_FinalizeEx's garbage collection, the
# aborting thread a gloo worker): ProcessGroupGloo runs collectives on its own worker threads
# (pt_gloo_runloop). A worker drops its reference to a finished Work only *after* marking it complete, so
# the main thread can return from `wait()` and reach the end of the script before the worker has let go of
# the Work; on a loaded machine that gap is long. Worse, `ProcessGroupGloo::barrier` keeps weak references
# to every Work still held by a worker when it is called (to wait for them), and a weakly referenced Work
# is destructed only when the last weak reference goes: so the tensors of e.g. the all-gathers of
# `save_model` live until the worker thread destroys the barrier that followed them. Those tensors have
# Python wrappers, and (torch 2.13, c10/util/intrusive_ptr.h) a TensorImpl whose count drops from two to
# one releases its PyObject (`decref_pyobject`), which takes the GIL. Once the interpreter is finalizing,
# taking the GIL from a non-Python thread calls `PyThread_exit_thread()` -> `pthread_exit()`, whose forced
# unwind runs into the noexcept `~AsyncAllgatherCoalescedWork` -> `std::terminate()`. Calling
# `dist.destroy_process_group()` does not prevent it: gloo's `shutdown()` stops nothing, and the
# ProcessGroupGloo (with its threads) lives on for as long as anything references it (FSDP states, device
# meshes: garbage, collected during finalization).
#
# Fix: at exit, while the interpreter is fully alive (atexit), after all ranks have arrived (store
# rendezvous with a timeout), one gloo `barrier()` per group captures every Work a worker still holds, and
# that barrier Work is *parked*: kept referenced by us. A worker thread then only drops references and
# never destroys a Work (so never releases a tensor), whatever the timing. Then the groups are destroyed
# and unreachable ones collected (their destructors join the worker threads with the GIL released, while
# Python can still serve them). Parked Works are released on the main thread once no gloo worker thread
# is left, or else deliberately leaked at exit (a handful of Works; freeing them could happen on a worker
# thread during finalization, which is the bug). A rank exiting because of an uncaught exception skips the
# rendezvous (its peers may never arrive), so it exits non-zero at once; it only gives the worker threads
# up to a second, with the GIL released, to finish what they are releasing.
# ---------------------------------------------------------------------------------------------------------

_generation = 0  # process groups made by init_distributed in this process (part of the exit rendezvous key)
_exit_handler_pid: int | None = None  # pid that registered the handler (a forked child inherits atexit)
_parked: list = []  # gloo barrier Works kept alive so that no worker thread ever destroys a Work


def _register_exit_handler() -> None:
    global _exit_handler_pid
    if _exit_handler_pid is None:
        atexit.register(_teardown_at_exit)
    _exit_handler_pid = os.getpid()


def _exit_timeout_s() -> float:
    raw = os.environ.get(EXIT_TIMEOUT_VAR, "")
    try:
        return float(raw) if raw.strip() else _DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %s", EXIT_TIMEOUT_VAR, raw, _DEFAULT_EXIT_TIMEOUT_S)
        return _DEFAULT_EXIT_TIMEOUT_S


def _exiting_with_error() -> bool:
    """True when the interpreter exits because of an uncaught exception (Python records it in sys.last_*
    before running atexit handlers; `sys.exit(n)` is not detectable and takes the normal path)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _gloo_thread_states() -> list[str] | None:
    """Scheduler states ("R", "S", ...) of this process's gloo worker threads; None without /proc."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as handle:
                stat = handle.read()
        except OSError:  # the thread has just ended
            continue
        name, rest = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:]
        if name.startswith("pt_gloo"):
            states.append(rest[:1])
    return states


def _wait_for_idle_gloo_threads(max_s: float) -> None:
    """Best effort, bounded: sleep (GIL released) until no gloo worker thread is runnable twice in a row,
    so that one that is about to release a Work can take the GIL while the interpreter still serves it."""
    deadline = time.monotonic() + max_s
    quiet = 0
    while time.monotonic() < deadline:
        states = _gloo_thread_states()
        if not states:  # none left, or no /proc to look at (then a short fixed grace period)
            if states is None:
                time.sleep(min(0.1, max_s))
            return
        quiet = quiet + 1 if all(state in "SD" for state in states) else 0
        if quiet >= 2:
            return
        time.sleep(0.01)


def _release_parked(*, between_scripts: bool = False) -> None:
    """Drop the parked Works once no gloo worker thread can race us: none is left (they were joined), or, between
    scripts (`between_scripts`), where every collective has completed, none is running."""
    if not _parked:
        return
    states = _gloo_thread_states()
    if states == [] or (between_scripts and states is not None and all(state == "S" for state in states)):
        _parked.clear()


def release_destroyed_groups() -> None:
    """In a process that goes on after `destroy_distributed()`: free the parked Works once no gloo thread runs.

    A parked barrier Work holds its group's gloo context, and with it a `gloo_tcp_loop` thread; it stays
    parked when the destroy ran while something (a Trainer, Accelerate's state) still referenced the groups.
    A group still referenced elsewhere keeps its own threads; a parked Work no longer keeps its context's.
    The test suite's rank pool calls this between the scripts it runs.
    """
    if _parked and not dist.is_initialized():
        gc.collect()
        _release_parked(between_scripts=True)


def _exit_rendezvous(timeout_s: float) -> bool:
    """Wait (up to `timeout_s`) until every rank has reached its exit handler; False (and a warning) when
    a peer did not come or the store is gone. Store-based, so a timeout leaves nothing queued on gloo."""
    try:
        store = dist.distributed_c10d._get_default_store()
        key = f"shardtrain/exit/{os.environ.get(env.RESTART_COUNT, '0')}/{_generation}"
        if store.add(f"{key}/arrived", 1) == dist.get_world_size():
            store.set(f"{key}/all", "1")
        store.wait([f"{key}/all"], timedelta(seconds=timeout_s))
        return True
    except Exception as err:  # noqa: BLE001 - a timeout or a lost store: leave without the collective part
        logger.warning("rank %d: not every rank reached the end of the script within %.0f s (%s); exiting "
                       "without destroying the process group (set %s to wait longer)", get_rank(), timeout_s,
                       str(err).splitlines()[0] if str(err) else type(err).__name__, EXIT_TIMEOUT_VAR)
        return False


def _drain_and_destroy(timeout: float | None) -> None:
    """Collective: barrier on every group (gloo: the barrier Works are parked), destroy them all, collect
    garbage so unreferenced groups are destructed now. `timeout` (s) bounds the barrier waits."""
    if dist.get_backend() != "gloo":
        barrier()
    else:
        # Every group of this rank, in creation order (the same on every member); enqueue all barriers
        # first, then wait, so overlapping subgroups cannot wait on each other.
        works = []
        for group in list(dist.distributed_c10d._world.pg_names):
            if dist.get_backend(group) == "gloo":
                work = group.barrier()
                _parked.append(work)
                works.append(work)
        for work in works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=timeout))
    dist.destroy_process_group()
    gc.collect()
    _release_parked()


def _teardown_at_exit() -> None:
    """atexit handler registered by `init_distributed` (mechanism and fix: comment above)."""
    if _exit_handler_pid != os.getpid():
        return
    try:
        if _exiting_with_error():
            _wait_for_idle_gloo_threads(1.0)
        elif dist.is_initialized():
            timeout = _exit_timeout_s()
            if _exit_rendezvous(timeout):
                _drain_and_destroy(timeout)
            else:
                _wait_for_idle_gloo_threads(1.0)
        else:
            # Destroyed by the script (dist.destroy_process_group): groups only referenced by garbage
            # (FSDP states, meshes) are destructed now, joining their threads while Python is alive.
            gc.collect()
            _release_parked()
            _wait_for_idle_gloo_threads(1.0)
    except Exception as err:  # noqa: BLE001 - never turn a finished run into a failed exit
        logger.warning("rank %d: process-group teardown at exit failed: %s", get_rank(), err)
    if _parked:
        _release_parked()
    if _parked:  # gloo threads still alive: keep the parked Works forever (see the comment above)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_parked))


def find_free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
