"""How a checkpoint is written so that `checkpoint-<step>` is always complete: every rank writes into
`.tmp-checkpoint-<step>`, the ranks agree that each part worked (one all-reduce, so a failing rank never leaves
its peers waiting), and rank 0 writes the manifest, fsyncs and renames. The synchronous and the background save
share it.

    writes = AtomicWrites(output_dir, rank)
    final, tmp = writes.begin(step)
    writes.run_agreed(lambda: write_my_part(tmp), tmp, step)
    writes.run_agreed(lambda: writes.publish(tmp, final, step) if rank == 0 else None, tmp, step)
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from shardtrain.checkpoint.faults import fault_point
from shardtrain.checkpoint.layout import PREFIX, TMP_PREFIX
from shardtrain.checkpoint.manifest import write_manifest
from shardtrain.errors import CheckpointError
from shardtrain.parallel import collectives


class AgreedFailure(CheckpointError):
    """A save failure every rank knows about (raised on all ranks at once)."""

    agreed = True


def disk_full(error: BaseException | None, directory: Path) -> bool:
    """Whether a failed write ran out of space (torch.save and DCP lose the errno, so free space is checked)."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    if error is not None and ("No space left" in str(error) or "os error 28" in str(error)):
        return True
    try:
        return shutil.disk_usage(directory).free < (1 << 20)
    except OSError:
        return False


def fsync(path: Path) -> None:
    """Flush one file or directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then the directories, `root` last."""
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        fsync(path)


class AtomicWrites:
    """The temporary directory, the agreement and the commit of the checkpoints under `output_dir`.

    Args:
        output_dir: where `checkpoint-<step>` directories live.
        rank: this process's global rank (rank 0 creates, removes and renames directories).
    """

    def __init__(self, output_dir: Path, rank: int) -> None:
        self.output_dir, self.rank = output_dir, rank

    def begin(self, step: int) -> tuple[Path, Path]:
        """(final, temporary) directory of `step`; rank 0 makes a fresh temporary one (collective)."""
        final, tmp = self.output_dir / f"{PREFIX}{step}", self.output_dir / f"{TMP_PREFIX}{step}"

        def prepare() -> None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()

        self.run_agreed(prepare if self.rank == 0 else None, tmp, step)
        fault_point("save_start", step)
        return final, tmp

    def publish(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: manifest, fsync, rename `tmp` to `final` (swapping out an older copy of the same step)."""
        write_manifest(tmp)
        fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): swap, then drop the old copy
            old = self.output_dir / f"{TMP_PREFIX}{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        fsync(self.output_dir)

    def agree(self, problem: str | None, tmp: Path, step: int) -> None:
        """Collective: raise the same error on every rank if any rank passed a `problem`."""
        def fail() -> None:
            if problem is not None:
                raise CheckpointError(problem)

        self.run_agreed(fail, tmp, step)

    def run_agreed(self, work: Callable[[], object] | None, tmp: Path, step: int) -> None:
        """Run `work` (None: nothing on this rank), then agree across ranks that it worked everywhere.

        A rank that fails must not leave its peers waiting in the next collective: the failure is shared
        through one all-reduce, the partial directory is removed, and every rank raises the same error.
        """
        error: BaseException | None = None
        try:
            if work is not None:
                work()
        except AgreedFailure:
            raise  # a nested agreement already failed on every rank
        except (Exception, CheckpointException) as err:  # noqa: B014 - DCP's error is not always an Exception
            error = err
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        if collectives.get_backend() == "nccl":
            failed = failed.cuda()
        collectives.all_reduce(failed)
        if not int(failed.item()):
            return
        full = disk_full(error, self.output_dir)  # before the partial files go: torch.save loses the errno
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            message = (f"no space left on device in {self.output_dir} while saving {PREFIX}{step}; the partial "
                       f"checkpoint was removed and earlier checkpoints are intact. Free space, or lower "
                       f"save_total_limit")
        elif error is not None:
            message = f"could not save {PREFIX}{step} in {self.output_dir}: {type(error).__name__}: {error}"
        else:
            message = f"could not save {PREFIX}{step} in {self.output_dir}: another rank failed (see its error)"
        raise AgreedFailure(message) from error
