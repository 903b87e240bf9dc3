"""The asynchronous half of `CheckpointManager`: `save_async` and `wait` (building blocks in `async_save.py`).

A mixin of `CheckpointManager`; it uses the manager's `_start_save`, `_write_small_files`, `_commit` and `_all_ok`,
so the sync and async paths share the layout, the failure agreement and the commit.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shardtrain.checkpoint.async_save import (
    AlreadyStaged,
    InFlightSave,
    ReusableStager,
    background_job,
    checkpoint_group,
    gather_full,
    gatherable,
    group_agree,
    private_copy,
)
from shardtrain.checkpoint.faults import fault_point
from shardtrain.checkpoint.full import write_full_checkpoint
from shardtrain.checkpoint.hf_export import save_sharded_pretrained
from shardtrain.checkpoint.layout import OPTIMIZER_DIR, SHARDED_DIR


class AsyncSaveMixin:
    """`save_async` / `wait` for `CheckpointManager` (see shardtrain.checkpoint.async_save)."""

    def _init_async(self) -> None:
        # created at the first async save, kept for the life of the manager
        self._group: dist.ProcessGroup | None = None  # DCP's collectives
        self._gather_group: dist.ProcessGroup | None = None  # FULL_STATE_DICT's model gather
        self._stager: ReusableStager | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._in_flight: InFlightSave | None = None

    def save_async(self, step: int, state: Any, *, model_only: bool = False) -> Path:
        """Start writing `checkpoint-<step>`; returns the path it will have once committed.

        Waits for the previous async save first (and raises its error, on every rank). Returns once the
        state is staged in CPU memory and the small files are written; the DCP files, `model.safetensors`
        (FULL_STATE_DICT) and the commit (manifest, fsync, rename, rotate) follow in the background. Call
        `wait()` before relying on the checkpoint (the Trainer does at the next save and at the end of train).

        Raises:
            CheckpointError: the previous save, or this one's synchronous part, failed on some rank; every
                rank raises it and the partial `.tmp-checkpoint-<step>` is removed.
        """
        self.wait()
        if self._group is None:  # collective: every rank saves at the same step
            self._group, self._gather_group = checkpoint_group(), checkpoint_group()
        if self._worker is None:
            self._stager = ReusableStager()
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtrain-checkpoint")
        final, tmp = self._start_save(step)
        staged: dict[str, Any] = {}
        self._all_ok(lambda: staged.update(self._stage(tmp, state, model_only)), tmp, step)
        fault_point("after_model", step)
        # Every rank staged and wrote its small files: from here on nothing can fail before the background part.
        upload = None
        if staged["dcp"]:
            upload = dcp.async_save(staged["dcp"], checkpoint_id=str(tmp / staged["dcp_dir"]),
                                    process_group=self._group, async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                    async_stager=AlreadyStaged())
        write_model = None
        if staged["full"] is not None or staged["shards"] is not None:
            write_model = partial(self._write_full_model, tmp, staged["full"], staged["shards"],
                                  staged["distributed"])
        keep = state.best_model_checkpoint

        def commit() -> None:
            fault_point("before_commit", step)
            if self.rank == 0:
                self._commit(tmp, final, step, keep)

        future = self._worker.submit(background_job, write_model, upload, commit)
        self._in_flight = InFlightSave(step, tmp, final, future)
        return final

    def _stage(self, tmp: Path, state: Any, model_only: bool) -> dict[str, Any]:
        """The synchronous part of an async save on this rank: stage the state, write the small files.

        Returns the staged DCP payload and its directory, and for FULL_STATE_DICT either the staged model
        shards (`shards`, gathered in the background) or the model already gathered on rank 0 (`full`,
        when the sharding is not plain FSDP, e.g. HSDP: gathered here, through the training group).
        """
        with_optim = self.optimizer is not None and not model_only
        states = self.states()
        # FULL_STATE_DICT: every rank writes its part of the model files (as the synchronous save), unless the
        # model is not sharded plainly (adapters, XLA, non-float states): then rank 0 gathers it
        shards = self._distributed_full() if self.state_dict_type != "SHARDED_STATE_DICT" else None
        payload: dict[str, Any] = {"model": states.model_state() if shards is None else shards}
        full = None
        if self.state_dict_type != "SHARDED_STATE_DICT" and shards is None and not gatherable(payload["model"]):
            # collective; rank 0 gets the model, the others {}
            gathered = states.full_model_state()
            full = private_copy(gathered, self.model) if self.rank == 0 else {}
            del gathered, payload["model"]
        if with_optim:
            payload["optimizer"] = states.optimizer_state()
        staged = self._stager.stage(payload)
        self._write_small_files(tmp, state, model_only)
        if self.state_dict_type == "SHARDED_STATE_DICT":
            return {"dcp": staged, "dcp_dir": SHARDED_DIR, "full": None, "shards": None}
        dcp_payload = {"optimizer": staged["optimizer"]} if with_optim else {}
        return {"dcp": dcp_payload, "dcp_dir": OPTIMIZER_DIR, "full": full, "shards": staged.get("model"),
                "distributed": shards is not None}

    def _write_full_model(self, tmp: Path, full: dict[str, torch.Tensor] | None, shards: dict[str, Any] | None,
                          distributed: bool) -> None:
        """Background, FULL_STATE_DICT, over the checkpoint's own gloo group: every rank writes its part of the
        staged shards into Hugging Face's layout (`distributed`), none holding the model whole; else the shards
        are gathered on rank 0 (unless that was done already) and rank 0 writes model.safetensors."""
        if distributed:
            save_sharded_pretrained(self.model, tmp, None, rank=self.rank, world_size=dist.get_world_size(),
                                    state=shards, agree=partial(group_agree, self._gather_group),
                                    process_group=self._gather_group)
            return
        if full is None:
            full = gather_full(shards, self._gather_group)
            for alias in self.states().tied_aliases():
                full.pop(alias, None)
        if self.rank == 0:
            write_full_checkpoint(full, tmp, None)

    def wait(self) -> Path | None:
        """Wait for the async save in flight (collective); returns its committed path, or None if none was.

        Raises:
            CheckpointError: its background part failed on some rank; raised on every rank, and the partial
                `.tmp-checkpoint-<step>` is removed (earlier checkpoints are untouched).
        """
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        self._all_ok(pending.future.result, pending.tmp, pending.step)
        return pending.final
