"""A finished multi-rank run exits 0 (no "terminate called without an active exception" at interpreter exit),
whether or not the script tears the process group down; a rank that raises still fails the launch promptly.

The abort (see `shardtrain.parallel.distributed`, comment above `_teardown_at_exit`): a gloo worker thread
destroys a finished Work (and a Work that a later barrier weakly references) after the main thread has
moved on; freeing the Work's tensors takes the GIL, which kills the thread once the interpreter is
finalizing. With real Trainer runs it is a rare timing race, so `RACE_WORKER` forces the timing: rank 0's
barrier (holding a weak reference to a running all-reduce) completes while rank 0's main thread sits in a
C-level atexit callback holding the GIL, and is released only once the interpreter is finalizing.
"""

import time
from concurrent.futures import ThreadPoolExecutor

from launch import REPO, torchrun

TRAIN_WORKER = REPO / "scripts" / "stress_teardown_worker.py"

RACE_WORKER = '''
import atexit
import ctypes
import gc
import sys
import time

# atexit runs handlers last-registered first, so these two run after shardtrain's: C code that holds the GIL
# for 3 s (no bytecode: a gloo worker thread that wants the GIL meanwhile waits until finalization has
# begun), then automatic garbage collection is back on for the finalization (it collects `holder` below).
atexit.register(gc.enable)
atexit.register(ctypes.PyDLL(None).usleep, 3_000_000)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class ReleasesGilDuringFinalization:
    def __del__(self, sleep=time.sleep):  # bound now: the module's `time` may be None by the time this runs
        sleep(0.3)


def main(mode):
    if mode == "torch":  # control: plain torch, no shardtrain exit handler
        dist.init_process_group("gloo")
    else:
        from shardtrain.parallel.distributed import destroy_distributed, init_distributed

        init_distributed()
    rank = dist.get_rank()
    group = dist.distributed_c10d._get_default_group()
    store = dist.distributed_c10d._get_default_store()
    gc.disable()
    holder = [group]
    holder.append(holder)  # a reference cycle keeps the group alive until a collection, as FSDP states do
    at_exit = mode in ("torch", "none")  # the destroy modes wait for rank 1 in the script itself
    if rank == 0 and at_exit:
        atexit.register(store.set, "rank0_exiting", "1")  # runs first at exit, just before the 3-s GIL hold
    if rank == 1:
        # rank 0's all-reduce is still running when it calls barrier(); when rank 0 is exiting, its barrier
        # completes inside the GIL hold (waiting for a signal, not a fixed time: a busy machine delays either)
        if at_exit:
            store.wait(["rank0_exiting"])
            time.sleep(0.5)
        else:
            time.sleep(1.0)
    tensor = torch.ones(1 << 16)
    work = group.allreduce([tensor])
    barrier = group.barrier()  # weakly references `work`: destroying the barrier frees `tensor` (takes the GIL)
    del tensor, work
    if rank == 1:
        barrier.wait()
    if mode == "destroy":
        destroy_distributed()
    elif mode == "torch_destroy":
        dist.destroy_process_group()
    del holder
    print(f"rank {rank} done", flush=True)


main(sys.argv[1])
keep = ReleasesGilDuringFinalization()
'''


def _launch_all(launches: dict[str, tuple]) -> dict[str, tuple[object, float]]:
    """Run several 2-rank torchrun launches at once (each on its own port): (CompletedProcess, seconds)."""
    def one(args):
        start = time.monotonic()
        proc = torchrun(*args, check=False, timeout=300)
        return proc, time.monotonic() - start

    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {name: pool.submit(one, args) for name, args in launches.items()}
    return {name: future.result() for name, future in futures.items()}


def _clean(proc) -> bool:
    return proc.returncode == 0 and "terminate called" not in proc.stderr


def test_forced_exit_race(tmp_path):
    """Control (plain torch) aborts, so the race is really exercised; with shardtrain's exit handler every
    ending (no teardown, destroy_distributed, dist.destroy_process_group) exits 0."""
    script = tmp_path / "race_worker.py"
    script.write_text(RACE_WORKER)
    modes = ["torch", "none", "destroy", "torch_destroy"]
    results = _launch_all({mode: (script, 2, mode) for mode in modes})
    control, _ = results.pop("torch")
    assert control.returncode != 0 and "terminate called" in control.stderr, \
        f"the forced timing no longer aborts plain torch ({control.returncode}):\n{control.stderr[-3000:]}"
    for mode, (proc, _) in results.items():
        assert _clean(proc), f"{mode}: returncode {proc.returncode}\n{proc.stderr[-4000:]}"
        assert proc.stdout.count(" done") == 2, f"{mode}: {proc.stdout[-2000:]}"


def test_trainer_runs_exit_cleanly_and_failures_fail_fast(tmp_path):
    """Trainer jobs (SHARDED_STATE_DICT checkpoint, evaluate, save_model) in scripts that never tear the
    group down exit 0, three launches at once; a launch where rank 1 raises fails within a bounded time."""
    launches = {f"run{i}": (TRAIN_WORKER, 2, str(tmp_path / f"run{i}"), "--jobs", "1") for i in range(3)}
    launches["raise"] = (TRAIN_WORKER, 2, str(tmp_path / "raise"), "--jobs", "1", "--raise-on-rank", "1")
    results = _launch_all(launches)
    failed, seconds = results.pop("raise")
    assert failed.returncode != 0 and "fails on purpose" in failed.stderr, failed.stderr[-3000:]
    assert seconds < 120, f"a failing rank took {seconds:.0f} s to end its launch"
    for name, (proc, _) in results.items():
        assert _clean(proc), f"{name}: returncode {proc.returncode}\n{proc.stderr[-4000:]}"
        job = tmp_path / name / "job0"
        assert (job / "final" / "config.json").is_file()
        assert any(p.name.startswith("checkpoint-") for p in job.iterdir())
