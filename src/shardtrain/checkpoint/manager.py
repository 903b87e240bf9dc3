"""`CheckpointManager`: save / save_async / load / resumable / close over model, optimizer, scheduler, state.

Layout of `output_dir/checkpoint-<step>/`:
    config.json                     model config (what `merge` and `from_pretrained` need)
    model.safetensors (+ index)     FULL_STATE_DICT: the model, loadable by `from_pretrained`; a sharded model's
                                    files are written and read by every rank (its shards; `hf_export`), others'
                                    gathered on rank 0
    optimizer/                      FULL_STATE_DICT: optimizer state through DCP (one file per rank)
    sharded/                        SHARDED_STATE_DICT: model + optimizer through DCP (one file per rank)
    scheduler.json, trainer_state.json, rng_state_<rank>.pt

Crash safety: everything is written under `.tmp-checkpoint-<step>`; when every rank has finished, rank 0
fsyncs the files and renames the directory (atomic on one filesystem; multi-node runs need a shared one).
So a directory named `checkpoint-<step>` is always complete, and rotation runs only after the new one exists.

`save_async` writes the same files with the same commit, the large part in the background (see
`shardtrain.checkpoint.async_save` for how, and what stays synchronous).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardtrain.checkpoint.async_manager import AsyncSaveMixin
from shardtrain.checkpoint.faults import fault_point
from shardtrain.checkpoint.full import read_full_checkpoint, read_full_shapes, write_full_checkpoint
from shardtrain.checkpoint.hf_export import distributed_state, read_sharded_pretrained, save_sharded_pretrained
from shardtrain.checkpoint.layout import (  # noqa: F401 (PREFIX, SHARDED_DIR, ...: re-exported for the Trainer)
    BASE_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    NAME,
    OPTIMIZER_DIR,
    PREFIX,
    RNG_PREFIX,
    SCHEDULER_FILE,
    SHARDED_DIR,
    STATE_FILE,
    TIED_FILE,
    TMP_PREFIX,
)
from shardtrain.checkpoint.manifest import manifest_problem, write_manifest
from shardtrain.checkpoint.model_state import (  # noqa: F401 - re-exported
    base_problem,
    full_model_state,
    model_class_name,
    model_config_dict,
    rng_state,
    set_rng_state,
    tied_aliases,
)
from shardtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata
from shardtrain.checkpoint.state_access import TorchStates
from shardtrain.errors import CheckpointError
from shardtrain.parallel.distributed import barrier


def checkpoint_kind(path: Path) -> str:
    """"SHARDED_STATE_DICT" or "FULL_STATE_DICT" from the files present."""
    if (path / SHARDED_DIR).is_dir():
        return "SHARDED_STATE_DICT"
    if (path / MODEL_FILE).is_file() or (path / MODEL_INDEX_FILE).is_file():
        return "FULL_STATE_DICT"
    raise CheckpointError(f"{path} holds no model (no sharded/ and no model.safetensors); pass a checkpoint-<step> "
                          "directory written by shardtrain")


def _disk_full(error: BaseException | None, directory: Path) -> bool:
    """Whether a failed write ran out of space (torch.save and DCP lose the errno, so free space is checked)."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    if error is not None and ("No space left" in str(error) or "os error 28" in str(error)):
        return True
    try:
        return shutil.disk_usage(directory).free < (1 << 20)
    except OSError:
        return False


def _fsync(path: Path) -> None:
    """Flush one file or directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then the directories, `root` last."""
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        _fsync(path)


class _AgreedFailure(CheckpointError):
    """A save failure every rank knows about (raised on all ranks at once)."""

    agreed = True


class CheckpointManager(AsyncSaveMixin):
    """Saves and restores a training run. All ranks call every method (they are collective).

    Args:
        output_dir: where `checkpoint-<step>` directories live.
        model, optimizer, scheduler: the objects to save; optimizer/scheduler may be None (model only).
        state_dict_type: "FULL_STATE_DICT" or "SHARDED_STATE_DICT".
        save_total_limit: keep at most this many checkpoints (the best one is never deleted).
        frozen_base: for adapter training (LoRA): `frozen_identity` of the model before sharding. Checkpoints then
            hold the trainable parameters only, and loading one trained on another base is refused.
        extra_files: name -> text, written into every checkpoint by rank 0 (e.g. adapter_config.json).
        state_access: how model and optimizer state are read and written (`TorchStates`; the XLA backend
            passes its own).
    """

    def __init__(self, output_dir: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 scheduler: Any | None, state_dict_type: str = "FULL_STATE_DICT",
                 save_total_limit: int | None = None, frozen_base: dict[str, Any] | None = None,
                 extra_files: dict[str, str] | None = None, state_access: type = TorchStates) -> None:
        self.output_dir = Path(output_dir)
        self.extra_files = dict(extra_files or {})
        self.frozen_base = frozen_base
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.state_access = state_access
        self.state_dict_type = state_dict_type
        self.save_total_limit = save_total_limit
        self.rank = dist.get_rank()
        self._init_async()

    def states(self) -> TorchStates:
        """Access to the current model and optimizer state (see `shardtrain.checkpoint.state_access`)."""
        return self.state_access(self.model, self.optimizer, trainable_only=self.frozen_base is not None)

    # -- public API -----------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, model_only: bool = False) -> Path:
        """Write `checkpoint-<step>` atomically and rotate old ones; returns its path.

        `state` is the trainer state: anything with `.save(path)` and a `best_model_checkpoint` attribute.

        Raises:
            CheckpointError: a rank could not write its part (disk full, permissions); every rank raises it,
                the partial `.tmp-checkpoint-<step>` is removed and the existing checkpoints are untouched.
        """
        final, tmp = self._start_save(step)
        self._all_ok(lambda: self._write(tmp, state, model_only), tmp, step)
        fault_point("before_commit", step)
        self._all_ok(lambda: self._commit(tmp, final, step, state.best_model_checkpoint) if self.rank == 0 else None,
                     tmp, step)
        return final

    def _start_save(self, step: int) -> tuple[Path, Path]:
        """(final, temporary) directory of `step`; rank 0 makes a fresh temporary one (collective)."""
        final, tmp = self.output_dir / f"{PREFIX}{step}", self.output_dir / f"{TMP_PREFIX}{step}"

        def prepare() -> None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()

        self._all_ok(prepare if self.rank == 0 else None, tmp, step)
        fault_point("save_start", step)
        return final, tmp

    def _write(self, tmp: Path, state: Any, model_only: bool) -> None:
        """Every rank writes its part of the checkpoint into `tmp` (collective)."""
        step = state.global_step
        with_optim = self.optimizer is not None and not model_only
        states = self.states()
        if self.state_dict_type == "SHARDED_STATE_DICT":
            payload: dict[str, Any] = {"model": states.model_state()}
            if with_optim:
                payload["optimizer"] = states.optimizer_state()
            dcp.save(payload, checkpoint_id=str(tmp / SHARDED_DIR))
        else:
            if (shards := self._distributed_full()) is not None:  # every rank writes its part of the files
                save_sharded_pretrained(self.model, tmp, None, rank=self.rank, world_size=dist.get_world_size(),
                                        state=shards, agree=lambda problem: self._agree(problem, tmp, step))
            else:
                full = states.full_model_state()
                self._all_ok(lambda: write_full_checkpoint(full, tmp, None) if self.rank == 0 else None, tmp, step)
                del full
            del shards
            if with_optim:
                dcp.save({"optimizer": states.optimizer_state()}, checkpoint_id=str(tmp / OPTIMIZER_DIR))
        fault_point("after_model", step)
        self._write_small_files(tmp, state, model_only)

    def _write_small_files(self, tmp: Path, state: Any, model_only: bool) -> None:
        """RNG state of every rank; on rank 0 config, tied names, scheduler and trainer state."""
        torch.save(rng_state(), tmp / f"{RNG_PREFIX}{self.rank}.pt")
        if self.rank == 0:
            config = model_config_dict(self.model)
            if config is not None:
                (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            (tmp / TIED_FILE).write_text(json.dumps(self.states().tied_aliases()))
            if self.frozen_base is not None:
                (tmp / BASE_FILE).write_text(json.dumps(self.frozen_base, indent=2))
            for name, text in self.extra_files.items():
                (tmp / name).write_text(text)
            if self.scheduler is not None and not model_only:
                (tmp / SCHEDULER_FILE).write_text(json.dumps(self.scheduler.state_dict()))
            state.save(tmp / STATE_FILE)

    def _commit(self, tmp: Path, final: Path, step: int, keep: str | None) -> None:
        """Rank 0: manifest, fsync, rename `tmp` to `final`, rotate."""
        write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): swap, then drop the old copy
            old = self.output_dir / f"{TMP_PREFIX}{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync(self.output_dir)
        fault_point("before_rotate", step)
        self._rotate(keep=keep)

    def _distributed_full(self) -> dict[str, torch.Tensor] | None:
        """FULL_STATE_DICT's model files written and read by every rank, none holding the model whole
        (`hf_export`): this rank's shards, or None where they are gathered on rank 0 (adapters only, XLA, an
        unsharded model, non-float states)."""
        if self.state_access is not TorchStates or self.frozen_base is not None:
            return None
        return distributed_state(self.model)

    def _agree(self, problem: str | None, tmp: Path, step: int) -> None:
        """Collective: raise the same error on every rank if any rank passed a `problem`."""
        def fail() -> None:
            if problem is not None:
                raise CheckpointError(problem)

        self._all_ok(fail, tmp, step)

    def _all_ok(self, work: Any, tmp: Path, step: int) -> None:
        """Run `work` (None: nothing on this rank), then agree across ranks that it worked everywhere.

        A rank that fails must not leave its peers waiting in the next collective: the failure is shared
        through one all-reduce, the partial directory is removed, and every rank raises the same error.
        """
        error: BaseException | None = None
        try:
            if work is not None:
                work()
        except _AgreedFailure:
            raise  # a nested agreement already failed on every rank
        except (Exception, CheckpointException) as err:  # noqa: B014 - DCP's error is not always an Exception
            error = err
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            failed = failed.cuda()
        dist.all_reduce(failed)
        if not int(failed.item()):
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(error, self.output_dir):
            message = (f"no space left on device in {self.output_dir} while saving {PREFIX}{step}; the partial "
                       f"checkpoint was removed and earlier checkpoints are intact. Free space, or lower "
                       f"save_total_limit")
        elif error is not None:
            message = f"could not save {PREFIX}{step} in {self.output_dir}: {type(error).__name__}: {error}"
        else:
            message = f"could not save {PREFIX}{step} in {self.output_dir}: another rank failed (see its error)"
        raise _AgreedFailure(message) from error

    @classmethod
    def resumable(cls, output_dir: str | Path) -> tuple[Path | None, list[str]]:
        """The newest checkpoint whose files match its manifest, and one warning per newer damaged one."""
        warnings = []
        for path in reversed(cls.list_checkpoints(output_dir)):
            problem = manifest_problem(path)
            if problem is None:
                return path, warnings
            warnings.append(f"skipping damaged checkpoint {path}: {problem}")
        return None, warnings

    @staticmethod
    def read_state(path: str | Path) -> dict[str, Any]:
        """The trainer state saved in checkpoint `path`, after checking the checkpoint against its manifest."""
        path = Path(path)
        problem = manifest_problem(path)
        if problem is not None:
            raise CheckpointError(f"cannot load checkpoint {path}: {problem}. Resume from another checkpoint, or "
                                  f"use resume_from_checkpoint='auto' to take the newest undamaged one")
        return json.loads((path / STATE_FILE).read_text())

    def load(self, path: str | Path, *, weights_only: bool = False) -> dict[str, Any] | None:
        """Restore model (and unless `weights_only`, optimizer, scheduler, RNG) from `path`.

        Returns:
            The saved trainer state as a dict (None when `weights_only`).

        Raises:
            CheckpointError: missing/corrupt files or a checkpoint of another model (names the first bad key).
        """
        path = Path(path)
        state = self.read_state(path)
        kind = checkpoint_kind(path)
        problem = base_problem(path, self.frozen_base)
        if problem is not None:
            raise CheckpointError(f"cannot load checkpoint: {problem}")
        self._check_shapes(path, kind)
        load_optim = self.optimizer is not None and not weights_only
        try:
            if kind == "SHARDED_STATE_DICT":
                self._load_sharded(path, load_optim)
            else:
                self._load_full(path, load_optim)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as err:  # DCP / safetensors errors on damaged files
            raise CheckpointError(f"could not read checkpoint {path}: {type(err).__name__}: {err}. The files are "
                                  f"corrupt or truncated; resume from an earlier checkpoint") from err
        if weights_only:
            return None
        if self.scheduler is not None and (path / SCHEDULER_FILE).is_file():
            self.scheduler.load_state_dict(json.loads((path / SCHEDULER_FILE).read_text()))
        rng_file = path / f"{RNG_PREFIX}{self.rank}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved: those ranks keep their seed
            set_rng_state(torch.load(rng_file, weights_only=True))
        return state

    def close(self) -> None:
        """Wait for an async save in flight (raising its error), release its buffers and thread; then a barrier."""
        self.wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._stager.close()
            self._worker = self._stager = None
        barrier()

    # -- internals ------------------------------------------------------------------------------------
    @staticmethod
    def list_checkpoints(output_dir: str | Path) -> list[Path]:
        """Committed checkpoints, oldest first (temporary directories never match)."""
        root = Path(output_dir)
        if not root.is_dir():
            return []
        # A checkpoint-<step> name exists only after the atomic rename: the directory was complete then.
        found = [(int(m.group(1)), p) for p in root.iterdir() if (m := NAME.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def _rotate(self, keep: str | None) -> None:
        """Hugging Face's rotation (`transformers.trainer_utils.rotate_checkpoints`): at most `save_total_limit`
        checkpoints, never deleting the newest (to resume) nor the best (`keep`)."""
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(str(self.output_dir), self.save_total_limit, best_model_checkpoint=keep)

    def keep_best_only(self, best: str | None) -> None:
        """The end of training as Hugging Face's: with `save_total_limit` 1 only the best checkpoint stays.

        Every rank calls it after loading the best checkpoint; rank 0 deletes once all have.
        """
        from transformers.trainer_utils import sort_checkpoints

        if self.save_total_limit != 1 or not best:
            return
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            for checkpoint in sort_checkpoints(str(self.output_dir), best_model_checkpoint=best):
                if not os.path.samefile(checkpoint, best):
                    shutil.rmtree(checkpoint, ignore_errors=True)

    def _check_shapes(self, path: Path, kind: str) -> None:
        states = self.states()
        expected = states.shapes()
        if kind == "SHARDED_STATE_DICT":
            try:
                meta = read_dcp_metadata(path / SHARDED_DIR).state_dict_metadata
            except CheckpointError:  # refused by the restricted unpickler: keep its message
                raise
            except Exception as err:
                raise CheckpointError(f"{path / SHARDED_DIR} has no readable metadata ({err}); the checkpoint is "
                                      "corrupt or incomplete") from err
            saved = {k[len("model."):]: tuple(v.size) for k, v in meta.items()
                     if k.startswith("model.") and hasattr(v, "size")}
        else:
            saved = read_full_shapes(path)
        tied = states.tied_aliases()
        for key, shape in expected.items():
            got = saved.get(key, saved.get(tied.get(key, ""), None))
            if got is None:
                raise CheckpointError(f"checkpoint {path} does not match the model: key {key!r} is missing "
                                      f"(it was saved from a different model)")
            if tuple(got) != shape:
                raise CheckpointError(f"checkpoint {path} does not match the model: key {key!r} has shape "
                                      f"{tuple(got)} in the checkpoint but {shape} in the model")
        extra = sorted(set(saved) - set(expected))
        if extra:
            raise CheckpointError(f"checkpoint {path} does not match the model: unexpected key {extra[0]!r}")

    def _load_sharded(self, path: Path, load_optim: bool) -> None:
        states = self.states()
        payload: dict[str, Any] = {"model": states.model_state()}
        if load_optim:
            payload["optimizer"] = states.optimizer_state()
        dcp_load(payload, path / SHARDED_DIR)
        states.load_model_state(payload["model"])
        if load_optim:
            states.load_optimizer_state(payload["optimizer"])

    def _load_full(self, path: Path, load_optim: bool) -> None:
        states = self.states()
        if (shards := self._distributed_full()) is not None:  # each rank reads its slices of the files
            read_sharded_pretrained(shards, path)
            tied = {alias: shards[name] for alias, name in states.tied_aliases().items()}
            states.load_model_state({**shards, **tied})
            del shards
        else:
            full = read_full_checkpoint(path) if self.rank == 0 else {}
            states.load_full_model_state(full)
            del full
        if load_optim:
            if not (path / OPTIMIZER_DIR).is_dir():
                raise CheckpointError(f"{path} has no optimizer state (saved with save_only_model); it can seed "
                                      "a new run's weights but not resume one")
            optim = {"optimizer": states.optimizer_state()}
            dcp_load(optim, path / OPTIMIZER_DIR)
            states.load_optimizer_state(optim["optimizer"])
