"""`AsyncSaver`: the background saves of one `CheckpointManager` (building blocks in `async_save.py`).

It writes through its manager's public parts (`writes`: the temporary directory, the agreement and the commit;
`write_small_files`, `commit`, `distributed_full`, `states`), so the sync and async paths share the layout, the
failure agreement and the commit.
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
from shardtrain.parallel import collectives


class AsyncSaver:
    """The saves in the background of `manager` (`CheckpointManager.save_async`, `wait`, `close`), at most one in
    flight; its gloo groups, staging buffers and writer thread are created at the first save and kept until
    `close`."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._group: dist.ProcessGroup | None = None  # DCP's collectives
        self._gather_group: dist.ProcessGroup | None = None  # FULL_STATE_DICT's model gather
        self._stager: ReusableStager | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._in_flight: InFlightSave | None = None

    @property
    def in_flight(self) -> InFlightSave | None:
        return self._in_flight

    def save(self, step: int, state: Any, *, model_only: bool = False) -> Path:
        """`CheckpointManager.save_async`: stage, write the small files, then the rest and the commit (manifest,
        fsync, rename, rotate) in the background; returns the path the checkpoint will have once committed."""
        manager = self.manager
        self.wait()
        if self._group is None:  # collective: every rank saves at the same step
            self._group, self._gather_group = checkpoint_group(), checkpoint_group()
        if self._worker is None:
            self._stager = ReusableStager()
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtrain-checkpoint")
        final, tmp = manager.writes.begin(step)
        staged: dict[str, Any] = {}
        manager.writes.run_agreed(lambda: staged.update(self._stage(tmp, state, model_only)), tmp, step)
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
            if manager.rank == 0:
                manager.commit(tmp, final, step, keep)

        future = self._worker.submit(background_job, write_model, upload, commit)
        self._in_flight = InFlightSave(step, tmp, final, future)
        return final

    def _stage(self, tmp: Path, state: Any, model_only: bool) -> dict[str, Any]:
        """The synchronous part of an async save on this rank: stage the state, write the small files.

        Returns the staged DCP payload and its directory, and for FULL_STATE_DICT either the staged model
        shards (`shards`, gathered in the background) or the model already gathered on rank 0 (`full`,
        when the sharding is not plain FSDP, e.g. HSDP: gathered here, through the training group).
        """
        manager = self.manager
        with_optim = manager.optimizer is not None and not model_only
        states, sharded = manager.states(), manager.state_dict_type == "SHARDED_STATE_DICT"
        # FULL_STATE_DICT: every rank writes its part of the model files (as the synchronous save), unless the
        # model is not sharded plainly (adapters, XLA, non-float states): then rank 0 gathers it
        shards = manager.distributed_full() if not sharded else None
        payload: dict[str, Any] = {"model": states.model_state() if shards is None else shards}
        full = None
        if not sharded and shards is None and not gatherable(payload["model"]):
            # collective; rank 0 gets the model, the others {}
            gathered = states.full_model_state()
            full = private_copy(gathered, manager.model) if manager.rank == 0 else {}
            del gathered, payload["model"]
        if with_optim:
            payload["optimizer"] = states.optimizer_state()
        staged = self._stager.stage(payload)
        manager.write_small_files(tmp, state, model_only)
        if sharded:
            return {"dcp": staged, "dcp_dir": SHARDED_DIR, "full": None, "shards": None}
        dcp_payload = {"optimizer": staged["optimizer"]} if with_optim else {}
        return {"dcp": dcp_payload, "dcp_dir": OPTIMIZER_DIR, "full": full, "shards": staged.get("model"),
                "distributed": shards is not None}

    def _write_full_model(self, tmp: Path, full: dict[str, torch.Tensor] | None, shards: dict[str, Any] | None,
                          distributed: bool) -> None:
        """Background, FULL_STATE_DICT, over the checkpoint's own gloo group: every rank writes its part of the
        staged shards into Hugging Face's layout (`distributed`), none holding the model whole; else the shards
        are gathered on rank 0 (unless that was done already) and rank 0 writes model.safetensors."""
        manager = self.manager
        if distributed:
            save_sharded_pretrained(manager.model, tmp, None, rank=manager.rank,
                                    world_size=collectives.get_world_size(),
                                    state=shards, agree=partial(group_agree, self._gather_group),
                                    process_group=self._gather_group)
            return
        if full is None:
            full = gather_full(shards, self._gather_group)
            for alias in manager.states().tied_aliases():
                full.pop(alias, None)
        if manager.rank == 0:
            write_full_checkpoint(full, tmp, None)

    def wait(self) -> Path | None:
        """`CheckpointManager.wait`: the save in flight committed (its error raised on every rank)."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        self.manager.writes.run_agreed(pending.future.result, pending.tmp, pending.step)
        return pending.final

    def close(self) -> None:
        """Wait for the save in flight, then release the staging buffers and the writer thread."""
        self.wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._stager.close()
            self._worker = self._stager = None
