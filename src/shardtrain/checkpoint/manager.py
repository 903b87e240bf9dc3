"""`CheckpointManager`: save / save_async / load / resumable / close over model, optimizer, scheduler, state.

Layout of `output_dir/checkpoint-<step>/`:
    config.json                     model config (what `merge` and `from_pretrained` need)
    model.safetensors (+ index)     FULL_STATE_DICT: the model, loadable by `from_pretrained`; a sharded model's
                                    files are written and read by every rank (its shards; `hf_export`), others'
                                    gathered on rank 0
    optimizer/                      FULL_STATE_DICT: optimizer state through DCP (one file per rank)
    sharded/                        SHARDED_STATE_DICT: model + optimizer through DCP (one file per rank)
    scheduler.json, rng_state_<rank>.pt
    trainer_state.json (Hugging Face's), shardtrain_state.json (the batch plan and data position)
    (a run that shards nothing: Hugging Face's optimizer.pt, scheduler.pt and rng_state.pth instead, `hf_files`)

Resume reads these, and a checkpoint `transformers.Trainer` wrote (`hf_files`), on any number of ranks.

Crash safety: everything is written under `.tmp-checkpoint-<step>`; when every rank has finished, rank 0
fsyncs the files and renames the directory (atomic on one filesystem; multi-node runs need a shared one).
So a directory named `checkpoint-<step>` is always complete, and rotation runs only after the new one exists.

`save_async` writes the same files with the same commit, the large part in the background (see
`shardtrain.checkpoint.async_save` for how, and what stays synchronous).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from shardtrain.checkpoint import hf_files
from shardtrain.checkpoint.async_manager import AsyncSaver
from shardtrain.checkpoint.async_save import InFlightSave
from shardtrain.checkpoint.atomic import AtomicWrites
from shardtrain.checkpoint.faults import fault_point
from shardtrain.checkpoint.full import read_full_checkpoint, read_full_shapes, weights_problem, write_full_checkpoint
from shardtrain.checkpoint.hf_export import distributed_state, read_sharded_pretrained, save_sharded_pretrained
from shardtrain.checkpoint.layout import (
    BASE_FILE,
    ENGINE_STATE_FILE,
    NAME,
    OPTIMIZER_DIR,
    RNG_PREFIX,
    SCHEDULER_FILE,
    SHARDED_DIR,
    STATE_FILE,
    TIED_FILE,
    checkpoint_kind,
    checkpoint_kind_or_none,
    is_transformers_checkpoint,
    is_weight_file,
)
from shardtrain.checkpoint.manifest import listed_files, manifest_problem
from shardtrain.checkpoint.model_state import (
    base_problem,
    model_config_dict,
    rng_state,
    set_rng_state,
)
from shardtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata
from shardtrain.errors import CheckpointError
from shardtrain.parallel import collectives
from shardtrain.parallel.distributed import barrier
from shardtrain.parallel.states import TorchStates, clean_name, whole_model_keys


@dataclass
class RunParts:
    """The stateful parts a `CheckpointManager` saves and restores, given once."""

    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    processor: Any | None = None


class CheckpointManager:
    """Saves and restores a training run. All ranks call every method (they are collective).

    Args:
        output_dir: where `checkpoint-<step>` directories live.
        model: the (sharded or plain) model to save.
        optimizer: its optimizer; None saves the model only.
        scheduler: the learning-rate scheduler; may be None.
        state_dict_type: "FULL_STATE_DICT" or "SHARDED_STATE_DICT".
        save_total_limit: keep at most this many checkpoints (the best one is never deleted).
        frozen_base: for adapter training (LoRA): `frozen_identity` of the model before sharding. Checkpoints then
            hold the trainable parameters only, and loading one trained on another base is refused.
        extra_files: name -> text, written into every checkpoint by rank 0 (e.g. adapter_config.json).
        state_access: how model and optimizer state are read and written (`TorchStates`; the XLA backend
            passes its own).
        hf_layout: write Hugging Face's optimizer.pt, scheduler.pt and rng_state.pth (a run that shards
            nothing: one plain process), which `transformers.Trainer` resumes.
        training_args: in Hugging Face's layout, saved as its training_args.bin (written, never read).
        processor: the tokenizer / processor written into every checkpoint with the generation config
            (`hf_files.write_beside_model`), as transformers does; None: none.
        parts: instead of model, optimizer, scheduler and processor: an object whose attributes of those names
            are read at each save and load (the Trainer registers its parts once: `train.hooks.TrainerParts`).
    """

    def __init__(self, output_dir: str | Path, *, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any | None = None,
                 state_dict_type: str = "FULL_STATE_DICT", save_total_limit: int | None = None,
                 frozen_base: dict[str, Any] | None = None, extra_files: dict[str, str] | None = None,
                 state_access: type = TorchStates, hf_layout: bool = False, training_args: Any = None,
                 processor: Any = None, parts: Any = None) -> None:
        self.output_dir = Path(output_dir)
        self.extra_files = dict(extra_files or {})
        self.frozen_base = frozen_base
        # the stateful parts, registered once: read at every save and load (a Trainer's optimizer appears later)
        self.parts = parts if parts is not None else RunParts(model, optimizer, scheduler, processor)
        self.state_access = state_access
        self.state_dict_type = "FULL_STATE_DICT" if hf_layout else state_dict_type
        self.hf_layout, self.training_args = hf_layout, training_args
        self.save_total_limit = save_total_limit
        self.rank = collectives.get_rank()
        self.writes = AtomicWrites(self.output_dir, self.rank)  # the temporary directory, agreement, commit
        self._async = AsyncSaver(self)
        self.saved_step: int | None = None  # the newest checkpoint's step: saved (or started) here, or resumed from

    @property
    def model(self) -> nn.Module:
        return self.parts.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.parts.optimizer

    @property
    def scheduler(self) -> Any | None:
        return self.parts.scheduler

    @property
    def processor(self) -> Any | None:
        return self.parts.processor

    def states(self) -> TorchStates:
        """Access to the current model and optimizer state (see `shardtrain.parallel.states`)."""
        return self.state_access(self.model, self.optimizer, trainable_only=self.frozen_base is not None)

    # -- public API -----------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, model_only: bool = False) -> Path:
        """Write `checkpoint-<step>` atomically and rotate old ones; returns its path.

        `state` is the trainer state: anything with `.save(path)` and a `best_model_checkpoint` attribute.

        Raises:
            CheckpointError: a rank could not write its part (disk full, permissions); every rank raises it,
                the partial `.tmp-checkpoint-<step>` is removed and the existing checkpoints are untouched.
        """
        final, tmp = self.writes.begin(step)
        self.writes.run_agreed(lambda: self._write(tmp, state, model_only), tmp, step)
        fault_point("before_commit", step)
        self.writes.run_agreed(lambda: self.commit(tmp, final, step, state.best_model_checkpoint)
                               if self.rank == 0 else None, tmp, step)
        self.saved_step = step
        return final

    def save_async(self, step: int, state: Any, *, model_only: bool = False) -> Path:
        """Start writing `checkpoint-<step>` in the background; returns the path it will have once committed.

        Hugging Face's layout (`hf_layout`) is written synchronously: one process, `torch.save` of plain tensors.
        Waits for the previous async save first (and raises its error, on every rank). Returns once the state is
        staged in CPU memory and the small files are written; the rest and the commit follow in the background
        (see `shardtrain.checkpoint.async_save`). Call `wait()` before relying on the checkpoint (the Trainer does
        at the next save and at the end of train).

        Raises:
            CheckpointError: the previous save, or this one's synchronous part, failed on some rank; every
                rank raises it and the partial `.tmp-checkpoint-<step>` is removed.
        """
        if self.hf_layout:
            return self.save(step, state, model_only=model_only)
        path = self._async.save(step, state, model_only=model_only)
        self.saved_step = step
        return path

    def wait(self) -> Path | None:
        """Wait for the async save in flight (collective); returns its committed path, or None if none was.

        Raises:
            CheckpointError: its background part failed on some rank; raised on every rank, and the partial
                `.tmp-checkpoint-<step>` is removed (earlier checkpoints are untouched).
        """
        return self._async.wait()

    @property
    def in_flight(self) -> InFlightSave | None:
        """The async save started and not yet waited for (its step, directories and future), if any."""
        return self._async.in_flight

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
            if (shards := self.distributed_full()) is not None:  # every rank writes its part of the files
                save_sharded_pretrained(self.model, tmp, None, rank=self.rank, world_size=collectives.get_world_size(),
                                        state=shards, agree=lambda problem: self.writes.agree(problem, tmp, step))
            else:
                full = states.full_model_state()
                self.writes.run_agreed(lambda: write_full_checkpoint(full, tmp, None) if self.rank == 0 else None,
                                       tmp, step)
                del full
            del shards
            if with_optim and self.hf_layout:
                torch.save(self.optimizer.state_dict(), tmp / hf_files.OPTIMIZER_FILE)
            elif with_optim:
                dcp.save({"optimizer": states.optimizer_state()}, checkpoint_id=str(tmp / OPTIMIZER_DIR))
        fault_point("after_model", step)
        self.write_small_files(tmp, state, model_only)

    def write_small_files(self, tmp: Path, state: Any, model_only: bool) -> None:
        """RNG state of every rank; on rank 0 config, tied names, scheduler and trainer state."""
        if self.hf_layout:
            hf_files.save_rng(tmp, self.rank, collectives.get_world_size())
        else:
            torch.save(rng_state(), tmp / f"{RNG_PREFIX}{self.rank}.pt")
        if self.rank == 0:
            config = model_config_dict(self.model)
            if config is not None:
                (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            (tmp / TIED_FILE).write_text(json.dumps(self.states().tied_aliases()))
            hf_files.write_beside_model(tmp, self.model, self.processor)
            if self.frozen_base is not None:
                (tmp / BASE_FILE).write_text(json.dumps(self.frozen_base, indent=2))
            for name, text in self.extra_files.items():
                (tmp / name).write_text(text)
            if self.hf_layout and self.training_args is not None:
                torch.save(self.training_args, tmp / hf_files.TRAINING_ARGS_FILE)
            if self.scheduler is not None and not model_only and self.hf_layout:
                torch.save(self.scheduler.state_dict(), tmp / hf_files.SCHEDULER_FILE)
            elif self.scheduler is not None and not model_only:
                (tmp / SCHEDULER_FILE).write_text(json.dumps(self.scheduler.state_dict()))
            state.save(tmp)

    def commit(self, tmp: Path, final: Path, step: int, keep: str | None) -> None:
        """Rank 0: publish `tmp` as `final` (manifest, fsync, rename), then rotate, keeping `keep` (the best)."""
        self.writes.publish(tmp, final, step)
        fault_point("before_rotate", step)
        self._rotate(keep=keep)

    def distributed_full(self) -> dict[str, torch.Tensor] | None:
        """FULL_STATE_DICT's model files written and read by every rank, none holding the model whole
        (`hf_export`): this rank's shards, or None where they are gathered on rank 0 (adapters only, XLA, an
        unsharded model, non-float states)."""
        if self.state_access is not TorchStates or self.frozen_base is not None:
            return None
        return distributed_state(self.model)

    @classmethod
    def resumable(cls, output_dir: str | Path) -> tuple[Path | None, list[str]]:
        """The newest checkpoint whose files match its manifest (or, written by `transformers.Trainer`, holds a
        readable state and a model), and one warning per newer damaged one."""
        warnings = []
        for path in reversed(cls.list_checkpoints(output_dir)):
            problem = cls.problem(path)
            if problem is None:
                return path, warnings
            warnings.append(f"skipping damaged checkpoint {path}: {problem}")
        return None, warnings

    @staticmethod
    def problem(path: Path) -> str | None:
        """What makes checkpoint `path` unusable: files that do not match its manifest, or (written by
        `transformers.Trainer`, which keeps no manifest) an unreadable state or no model; None when usable."""
        if not is_transformers_checkpoint(path):
            problem = manifest_problem(path)
            if problem is None or checkpoint_kind_or_none(path) != "FULL_STATE_DICT":
                return problem
            # the model's safetensors files replaced since by others (e.g. split into shards with their index, as
            # transformers' tests do): those are checked instead, every header read; a listed file still there
            # but changed (truncated) stays a damaged checkpoint
            replaced = [name for name in listed_files(path) if is_weight_file(name) and not (path / name).exists()]
            if not replaced:
                return problem
            return manifest_problem(path, skip=lambda name: name in replaced) or weights_problem(path)
        try:
            json.loads((path / STATE_FILE).read_text())
            checkpoint_kind(path)
        except (ValueError, OSError, CheckpointError) as err:
            return f"{STATE_FILE} or the model files are not readable ({err})"
        return None

    @classmethod
    def read_state(cls, path: str | Path) -> dict[str, Any]:
        """The trainer state saved in checkpoint `path` (Hugging Face's fields and ours), after checking the
        checkpoint against its manifest."""
        path = Path(path)
        problem = cls.problem(path)
        if problem is not None:
            raise CheckpointError(f"cannot load checkpoint {path}: {problem}. Resume from another checkpoint, or "
                                  f"use resume_from_checkpoint='auto' to take the newest undamaged one")
        state = json.loads((path / STATE_FILE).read_text())
        if (path / ENGINE_STATE_FILE).is_file():
            state.update(json.loads((path / ENGINE_STATE_FILE).read_text()))
        return state

    def load(self, path: str | Path, *, weights_only: bool = False,
             state: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Restore model (and unless `weights_only`, optimizer, scheduler, RNG) from `path`; `state`: its saved
        trainer state when the caller has read it already (`read_state`).

        Returns:
            The saved trainer state as a dict (None when `weights_only`).

        Raises:
            CheckpointError: missing/corrupt files or a checkpoint of another model (names the first bad key).
        """
        path = Path(path)
        state = state if state is not None else self.read_state(path)
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
        elif self.scheduler is not None and (path / hf_files.SCHEDULER_FILE).is_file():
            self.scheduler.load_state_dict(hf_files.load_tensors(path / hf_files.SCHEDULER_FILE))
        self._load_rng(path)
        return state

    def _load_rng(self, path: Path) -> None:
        """This rank's RNG states, from our file or Hugging Face's; a rank without one (resuming on more ranks
        than saved) keeps its seed."""
        world = collectives.get_world_size()
        ours, theirs = path / f"{RNG_PREFIX}{self.rank}.pt", path / hf_files.rng_file(self.rank, world)
        problem = None
        try:
            if ours.is_file():
                set_rng_state(hf_files.load_tensors(ours))
            elif theirs.is_file():
                hf_files.set_rng(hf_files.load_tensors(theirs))
        except CheckpointError as err:  # one rank's file: every rank stops with its error, none waits on it
            problem = str(err)
        problems = [found for found in collectives.gather_objects(problem) if found is not None]
        if problems:
            error = CheckpointError(problems[0])
            error.agreed = True
            raise error

    def close(self) -> None:
        """Wait for an async save in flight (raising its error), release its buffers and thread; then a barrier."""
        self._async.close()
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
        parameters = {clean_name(name) for name, _ in self.model.named_parameters(remove_duplicate=False)}
        for key, shape in expected.items():
            got = saved.get(key, saved.get(tied.get(key, ""), None))
            if got is None:
                raise CheckpointError(f"checkpoint {path} does not match the model: key {key!r} is missing "
                                      f"(it was saved from a different model)")
            # a buffer's shape is the model's business (one may grow as it runs; its load_state_dict says)
            if tuple(got) != shape and key in parameters:
                raise CheckpointError(f"checkpoint {path} does not match the model: key {key!r} has shape "
                                      f"{tuple(got)} in the checkpoint but {shape} in the model")
        extra = sorted(set(saved) - whole_model_keys(self.model, set(expected)))
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
        if (shards := self.distributed_full()) is not None:  # each rank reads its slices of the files
            read_sharded_pretrained(shards, path)
            tied = {alias: shards[name] for alias, name in states.tied_aliases().items()}
            states.load_model_state({**shards, **tied})
            del shards
        else:
            full = read_full_checkpoint(path) if self.rank == 0 else {}
            states.load_full_model_state(full)
            del full
        if load_optim and (path / OPTIMIZER_DIR).is_dir():
            optim = {"optimizer": states.optimizer_state()}
            dcp_load(optim, path / OPTIMIZER_DIR)
            states.load_optimizer_state(optim["optimizer"])
        elif load_optim and (path / hf_files.OPTIMIZER_FILE).is_file():
            self._load_hf_optimizer(path / hf_files.OPTIMIZER_FILE)
        elif load_optim:
            raise CheckpointError(f"{path} has no optimizer state (saved with save_only_model); it can seed "
                                  "a new run's weights but not resume one")

    def _load_hf_optimizer(self, file: Path) -> None:
        """Hugging Face's `optimizer.pt` (parameters by position), read on every rank and sharded as it loads."""
        states = self.states()
        if not hasattr(states, "load_full_optimizer_state"):
            raise CheckpointError(f"{file} is Hugging Face's optimizer file, which this backend cannot load; "
                                  "resume it with the FSDP2 backend (fsdp_config without 'xla')")
        names = {param: clean_name(name) for name, param in self.model.named_parameters()}
        saved = hf_files.load_tensors(file)
        by_name = hf_files.optimizer_state_by_name(saved, self.optimizer, names, file)  # checks groups and shapes
        if any(isinstance(param, DTensor) for param in names):
            states.load_full_optimizer_state(by_name)  # each rank keeps its shard
        else:  # an unsharded model: the parameters are Hugging Face's, in the same order
            self.optimizer.load_state_dict(saved)
