"""One rank of the test suite's rank pool (`rank_pool.py`): started once, it runs the worker scripts the tests
send, each as `python SCRIPT ARGS...` (or one rank of `torchrun ... SCRIPT ARGS...`) would, in this process.

    torchrun --nproc_per_node 2 tests/rank_pool_server.py POOL_DIR     # a 2-rank pool
    python tests/rank_pool_server.py POOL_DIR                           # a one-process pool (no launcher)

What a new process would give each case, the pool gives it again: the case's own environment (torchrun's
variables kept), its argv, the script's folder first on sys.path and its modules imported anew, a fresh default
process group (the previous one destroyed), and afterwards the warning filters, loggers, signal handlers,
Accelerate's singletons and torch's global settings as they were. Its stdout and stderr (file descriptors 1 and
2, so C++ and logging output too) go to POOL_DIR/<case>-<rank>.out/.err; its exit code to
POOL_DIR/done-<case>-<rank>.json. What it does not reset (library module caches, threads left running) is why a
case that fails makes the test side restart the pool, and why it restarts one whose ranks report too many threads
(`thread_count`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

POOL = Path(sys.argv[1])
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
LAUNCHED = "RANK" in os.environ
LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP]

# what every case would import: paid once per pool
import accelerate.state  # noqa: E402
import datasets  # noqa: E402, F401
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import shardtrain  # noqa: E402, F401
from shardtrain.parallel.distributed import (  # noqa: E402
    destroy_distributed,
    init_distributed,
    release_destroyed_groups,
)

with contextlib.suppress(ImportError):  # the dev extra's libraries, when installed
    import peft  # noqa: F401
    import trl  # noqa: F401


class SavedState:
    """The process-wide settings a case may change, taken before it and put back after it."""

    def __init__(self) -> None:
        self.environ, self.argv, self.path, self.cwd = dict(os.environ), list(sys.argv), list(sys.path), os.getcwd()
        self.filters = list(warnings.filters)
        manager = logging.Logger.manager
        self.loggers = {name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
                        for name, lg in [("", logging.root), *manager.loggerDict.items()]
                        if isinstance(lg, logging.Logger)}
        self.signals = {s: signal.getsignal(s) for s in SIGNALS}
        self.torch = (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled(),
                      torch.are_deterministic_algorithms_enabled())
        self.hook = sys.excepthook

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        sys.argv[:], sys.path[:] = self.argv, self.path
        os.chdir(self.cwd)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()  # forgets which warnings were shown: a later case sees them again
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            lg = logging.root if name == "" else logging.getLogger(name)
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate, lg.disabled = propagate, disabled
        transformers.utils.logging.warning_once.cache_clear()
        transformers.utils.logging.info_once.cache_clear()
        for sig, handler in self.signals.items():
            if handler is not None:
                signal.signal(sig, handler)
        dtype, threads, grad, deterministic = self.torch
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)
        sys.excepthook = self.hook
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate.state.GradientState._reset_state()


@contextlib.contextmanager
def output_to(out: Path, err: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (and Python's streams over them) into `out` and `err` for the body."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "wb") as out_file, open(err, "wb") as err_file:
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def forget_old_meshes() -> None:
    """Empty torch.distributed's caches. A new DeviceMesh equals (and hashes as) an old one of the same shape, so a
    sharding plan cached in an earlier case would hand out that case's destroyed groups."""
    def clear(holder: object) -> None:
        for value in list(vars(holder).values()):
            value = getattr(value, "__func__", value)  # a cache under @staticmethod (MeshTopoInfo.build_from_mesh)
            if hasattr(value, "cache_clear") and not isinstance(value, type):
                value.cache_clear()

    with warnings.catch_warnings():  # reading a deprecated attribute (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith("torch.distributed"):
                continue
            clear(module)
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == name:
                    clear(value)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    clear(DTensor._op_dispatcher.sharding_propagator)
    _clear_sharding_prop_cache()  # the C++ fast path's cache too
    # Redistribution planners are kept per (weakref to the mesh, ...) but hold their mesh, so an old mesh and its
    # groups never go (a 16-job case with cp, tp and ep meshes left ~30 gloo threads per rank, and the pool restarted)
    from torch.distributed.tensor import _redistribute

    getattr(_redistribute, "_planner_cache", {}).clear()


def fresh_process_group(case: int, store: dist.TCPStore | None) -> None:
    """A new default group for the case, on a key prefix of its own in torchrun's store (a second rendezvous
    on the same keys would hang)."""
    if not LAUNCHED or dist.is_initialized():
        return
    if store is None:
        init_distributed()
    else:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"rank_pool/{case}/", store), rank=RANK,
                                world_size=WORLD)


def thread_count() -> int:
    """This process's threads (0 where /proc cannot tell), which the test side bounds by restarting the pool."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def forget_script_modules(folder: Path) -> None:
    """Drop the modules imported from the script's folder: a sibling module that reads sys.argv when imported
    (`workers/trl_runs.py`) must be imported again by the next case, as a new process would."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.dirname(file) == str(folder):  # imported through sys.path's str(folder) entry
            del sys.modules[name]


def run_script(script: str, args: list[str]) -> int:
    """Run `script` as `__main__` with `args`; its exit code as a process would have it."""
    sys.argv[:] = [script, *args]
    folder = Path(script).resolve().parent
    forget_script_modules(folder)
    sys.path.insert(0, str(folder))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, with the hooks the case set
        sys.excepthook(*sys.exc_info())
        return 1


def main() -> None:
    store = None
    case = 0
    while True:
        job_file = POOL / f"job-{case}.json"
        while not job_file.exists():
            time.sleep(0.02)
        job = json.loads(job_file.read_text())
        if job.get("stop"):
            break
        if LAUNCHED and case > 0 and store is None:
            from datetime import timedelta

            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=600))
        saved = SavedState()
        os.environ.clear()
        os.environ.update(job["env"])
        os.environ.update({k: v for k, v in saved.environ.items() if k in LAUNCHER_VARS or
                           k.startswith("TORCHELASTIC_")})
        with output_to(POOL / f"{case}-{RANK}.out", POOL / f"{case}-{RANK}.err"):
            if job.get("cwd"):
                os.chdir(job["cwd"])
            fresh_process_group(case, store)
            code = run_script(job["script"], job["args"])
            try:  # what a process exit would have done
                if code == 0 and dist.is_initialized():
                    destroy_distributed()
                forget_old_meshes()
            except BaseException:  # noqa: BLE001 - the pool cannot go on: reported with the case
                traceback.print_exc()
                code = code or 1
        saved.restore()
        release_destroyed_groups()  # after the restore, which drops Accelerate's hold on the case's groups
        done = POOL / f"done-{case}-{RANK}.json"
        done.with_suffix(".tmp").write_text(json.dumps({"rc": code, "threads": thread_count()}))
        done.with_suffix(".tmp").rename(done)
        if code != 0:  # the test side restarts the pool: whatever the case left behind goes with it
            break
        case += 1


if __name__ == "__main__":
    main()
