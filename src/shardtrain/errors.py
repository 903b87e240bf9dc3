"""User-facing errors: one line that names the problem and the fix, printed once per job.

Every error class a user can cause (a bad argument, config, dataset, checkpoint or environment variable) is
defined here, next to its one printer, and derives from `UserError`. `install_error_hook` replaces Python's
traceback for those errors with `error: <message>`; in a multi-rank job only rank 0 prints it when every rank
raised the same error (`agreed`, the default for configuration and data checks, which every rank runs on the
same input). Other exceptions keep the normal traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import TracebackType

_SILENT_RANK_EXIT_DELAY_S = 5.0


class UserError(Exception):
    """Base of errors caused by the user's input; `agreed`: every rank raises the same one."""

    agreed = True


# Every error a user can cause, by where it is found (each module raises its own; all print the same way)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or loaded as asked."""

    agreed = False  # may concern one rank's files; set True where every rank raises it together


class EnvError(UserError, ValueError):
    """An environment variable with a value shardtrain cannot read."""


class FSDPConfigError(UserError, ValueError):
    """An `fsdp_config` that cannot be used; the message names the key and the fix."""


class LaunchConfigError(UserError, ValueError):
    """A launch config that cannot be used; the message names the key and the fix."""


class ParallelismError(UserError, ValueError):
    """A parallelism setting that cannot be used; the message names the key and the fix."""


class ContextParallelError(UserError, ValueError):
    """A model or batch that context parallelism cannot run; the message names it and the fix."""


class ParallelDimsError(UserError, ValueError):
    """Parallel sizes that do not fit the ranks; the message names the sizes and a fix."""


class ReplicaGroupError(UserError, RuntimeError):
    """Replica groups (`fault_tolerance`) that cannot run: the lighthouse, the quorum, a peer's state."""

    agreed = False  # one group's ranks may see it alone (its peers go on)


class PipelineError(UserError, ValueError):
    """A pipeline-parallel setting or model that cannot be split into stages."""


class ExpertParallelError(UserError, ValueError):
    """A model or size expert parallelism cannot run; the message names it and the fix."""


class TensorParallelError(UserError, ValueError):
    """A model or plan tensor parallelism cannot run; the message names it and the fix."""


class PlanError(UserError, ValueError):
    """A planner input that cannot be used; the message names the input, its value and the fix."""


class TrainingArgumentsError(UserError, ValueError):
    """An argument that cannot be used; the message names the field and the fix."""


class TrainerOverrideError(UserError, TypeError):
    """A Trainer subclass overrides a method the engine never calls; the message names the method and the fix."""


class NotImplementedArgumentError(TrainingArgumentsError, NotImplementedError):
    """An argument value Hugging Face's `TrainingArguments` itself refuses as not implemented."""


class ChunkedLossError(UserError, ValueError):
    """`loss_chunk_size` asked for chunking on a model (or setup) where the chunked loss would not be exact."""


class PeftError(UserError, ValueError):
    """LoRA / PEFT used in a way shardtrain cannot run; the message names the fix."""


class LossError(UserError, TypeError):
    """A model whose outputs the Trainer cannot compute a loss from; the message says what to return."""


class DataError(UserError, ValueError):
    """A dataset the Trainer cannot train on; the message names the dataset, the sample and the fix."""


class StepGuardError(UserError, RuntimeError):
    """The step guard skipped too many steps in a row (TrainingArguments.step_guard's max_in_a_row)."""


class OutputDirError(UserError, OSError):
    """An output directory that cannot be written."""


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)


def print_line(text: str) -> None:
    """One line on stderr, starting a line of its own while a progress bar (tqdm's) is being drawn."""
    tqdm = sys.modules.get("tqdm")
    if getattr(getattr(tqdm, "tqdm", None), "_instances", None):
        text = "\n" + text
    print(text, file=sys.stderr, flush=True)


def report(error: BaseException) -> None:
    """Print `error` as one `error: ...` line on stderr (only on rank 0 when every rank has it)."""
    rank = _rank()
    agreed = getattr(error, "agreed", True)
    if rank == 0:
        print_line(f"error: {error}")
    elif not agreed:
        print_line(f"error (rank {rank}): {error}")
    else:
        # A silent rank that exits first makes torchrun stop rank 0 before it has printed the message; give
        # rank 0 a moment (torchrun ends this wait as soon as rank 0 has exited).
        time.sleep(_SILENT_RANK_EXIT_DELAY_S)


# A launcher-started rank (torchrun) that printed its `error:` line says so in torchrun's error file, so that
# `shardtrain launch` adds no second line of its own (it reads the message back from ChildFailedError).
# Only under our launcher: plain torchrun would print the reply in its own failure block anyway.
REPORTED_PREFIX = "shardtrain reported: "
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
LAUNCHED = "SHARDTRAIN_LAUNCHED"  # set to 1 by `shardtrain launch` in every rank's environment


def _leave_reply(error: BaseException) -> None:
    path = os.environ.get(TORCHELASTIC_ERROR_FILE)
    if not path or os.environ.get(LAUNCHED) != "1":
        return
    try:
        with open(path, "w") as file:
            json.dump({"message": f"{REPORTED_PREFIX}{error}", "timestamp": int(time.time())}, file)
    except OSError:  # a missing reply only costs the launcher's own summary line
        pass


_previous_hook = None
_installed = False


def _hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    if isinstance(error, UserError):
        _leave_reply(error)
        report(error)
    else:
        (_previous_hook or sys.__excepthook__)(kind, error, tb)


def install_error_hook() -> None:
    """Make uncaught `UserError`s print one line instead of a traceback (once per process; others untouched).

    Once: torch's distributed setup wraps `sys.excepthook` around ours, so "is ours installed?" cannot be
    read from `sys.excepthook`, and wrapping torch's wrapper again would make the two call each other.
    """
    global _previous_hook, _installed
    if not _installed:
        _previous_hook, _installed = sys.excepthook, True
        sys.excepthook = _hook
