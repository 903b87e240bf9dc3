"""The Trainer under replica groups (`fault_tolerance`): the loop's `StepGate`, the state a recovering group
receives, and the record of what was trained.

    gate = ReplicaGate.start(trainer, settings)       # joins the groups (torchft's Manager, the recovery server)
    TrainingRun(..., gate=gate).run(...)              # each step: quorum, (recovery), the step, the record
    gate.close()

A recovering group receives the model and optimizer shards of the same rank of a healthy group (the checkpoint
states), the scheduler, and the trainer state's progress (steps, data position, token counts, log history), as
JSON and safetensors (`parallel.recovery`); each step's RNG is seeded from the step (`ReplicaGate.begin`),
so there is no RNG stream to carry. Only the lowest group of a step's quorum writes the job's files for it:
checkpoints and `committed_batches.jsonl`, one line per committed step with the groups that took part and the
dataset indices they trained (`RECORD_FILE`).

The job's state is its output directory, and no group goes back in it: a group that starts resumes from the
newest checkpoint (train() resumes by default under replica groups), exits 0 at once when the record holds
`max_steps` (`exit_finished`), heals from a running peer that is ahead, and otherwise (no group running, the whole
job restarting) trains the record's steps after its checkpoint again, replacing their lines as they commit; a
record no checkpoint backs is refused (`_check_job`).

A dead group's share of a step (its slot: epoch, step, group) is lost. With `lost_batches: "refeed"` the lost
slots wait in the trainer state (`lost_slots`, in checkpoints and in what a recovering group receives); at each
step the i-th group of the quorum also trains the i-th waiting slot, as the group that lost it would have (its
samples, its collation seeds), and the record names it (`refed`). So every share of every step is trained once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from shardtrain.config.fault_tolerance import FaultTolerance
from shardtrain.errors import ReplicaGroupError
from shardtrain.parallel.replicas import ReplicaGroups, layout_signature
from shardtrain.train.data.batch_plan import BatchPlan, derive_seed
from shardtrain.train.data.training_data import Plan
from shardtrain.train.metrics.logger import truncate_jsonl
from shardtrain.train.step.optimizer_step import StepResult

RECORD_FILE = "committed_batches.jsonl"
# the trainer state's fields a recovering group takes from its peer (the callbacks' objects stay its own)
OWN_FIELDS = {"stateful_callbacks", "is_local_process_zero", "is_world_process_zero"}


class ReplicaGate:
    """The loop's `StepGate` for a Trainer (see the module docstring)."""

    replicas: ReplicaGroups  # set by `start` (its state functions are this gate's)

    def __init__(self, trainer: Any, dp_size: int, settings: FaultTolerance, max_steps: int) -> None:
        self.trainer, self.group_dp, self.settings, self.max_steps = trainer, dp_size, settings, max_steps
        self.record = Path(trainer.args.output_dir) / RECORD_FILE
        self._taken: list[list[int]] = []  # the waiting slots the quorum of the open step re-feeds
        self._mine: list[int] | None = None  # the one this group re-feeds
        self._joined = False  # the first quorum was formed and the job's state checked against it
        self._replace_after: int | None = None  # the record's lines after this step describe a state nobody holds

    @classmethod
    def start(cls, trainer: Any, settings: FaultTolerance, plan: Plan, max_steps: int) -> ReplicaGate:
        """Join the replica groups with `trainer`'s state (after its resume, if any)."""
        state, dims = trainer.state, trainer.dims
        signature = layout_signature(world=trainer.runtime.world_size, layout=dims.describe(),
                                     batch=plan.global_batch_size, steps=max_steps,
                                     params=sum(p.numel() for p in trainer.model.parameters()))
        gate = cls(trainer, dims.batch_size, settings, max_steps)
        gate.replicas = ReplicaGroups.start(settings, device=trainer.device, signature=signature,
                                            state_dict=gate.state_dict, load_state_dict=gate.load_state_dict,
                                            step=state.global_step + state.skipped_steps)
        return gate

    # -- the job's state: the output directory ------------------------------------------------------------
    def _check_job(self, step: int) -> None:
        """After the first quorum, when no running group was ahead of this one (it did not heal): the record
        decides. The job finished: exit. The record holds steps past `step` that no running group holds (every
        group died after them): they are trained again from the resumed checkpoint, their lines replaced as they
        commit; from step 0 they cannot be, so the group stops without writing anything."""
        last = committed_steps(self.trainer, self.record)
        if last >= self.max_steps:
            exit_finished(self.trainer, last)
        if last <= step:
            return
        if step == 0:
            raise ReplicaGroupError(
                f"replica group {self.settings.replica_group}: the job's record {self.record} holds steps 1..{last}, "
                f"but no running group holds them and {self.trainer.args.output_dir} has no checkpoint to resume "
                "from; nothing was written. Use a new output_dir to start the job anew, or save checkpoints "
                "(save_strategy) so a restarted job resumes")
        self._replace_after = step
        if self.trainer.rank == 0:
            print(f"replica group {self.settings.replica_group}: no running group holds steps {step + 1}..{last} "
                  f"of the record; they are trained again from checkpoint-{step}", flush=True)

    # -- the loop's gate ----------------------------------------------------------------------------------
    def begin(self, state: Any) -> bool:
        opened = not self.replicas.is_open
        step = state.global_step + state.skipped_steps
        moved = self.replicas.begin(step)
        if not self._joined:
            self._joined = True
            if not moved:
                self._check_job(state.global_step)
        # the step's RNG from (seed, step, group, rank) only: a healed group and a resumed job draw what an
        # uninterrupted one would
        torch.manual_seed(derive_seed(self.trainer.args.seed, "replica-step", step, self.replicas.group,
                                      self.trainer.rank))
        if opened or moved:  # who re-feeds what in this quorum (every group of it decides alike)
            self._taken, self._mine = [], None
            if self.settings.lost_batches == "refeed" and state.lost_slots:
                groups = self.replicas.participants()
                if groups is not None:
                    self._taken = [list(slot) for slot in state.lost_slots[:len(groups)]]
                    place = groups.index(self.replicas.group)
                    self._mine = self._taken[place] if place < len(self._taken) else None
        return moved

    def extend(self, data: Any, plan: Plan, batches: list[Any], placeholders: list[bool]
               ) -> tuple[list[Any], list[bool]]:
        if self._mine is None:
            return batches, placeholders
        epoch, step, group = self._mine
        rank = group * self.group_dp + self.trainer.runtime.dp_rank
        more, flags = data.slot_batches(plan, epoch, step, rank)
        return [*batches, *more], [*placeholders, *flags]

    def committed(self, plan: Plan, epoch: int, step: int, result: StepResult) -> None:
        state = self.trainer.state
        refed = self._taken
        if self.settings.lost_batches == "refeed":  # every group keeps the same list
            lost = [[epoch, step, g] for g in range(self.settings.replica_groups) if g not in result.groups]
            state.lost_slots = [slot for slot in state.lost_slots[len(refed):]] + lost
        self._taken, self._mine = [], None
        if not (self.replicas.writes and self.trainer.rank == 0):
            return
        if self._replace_after is not None:  # the first step trained again: the old lines from it on go
            self.truncate_after(self._replace_after)
            self._replace_after = None
        line = {"step": state.global_step, "epoch": epoch, "data_step": step, "groups": list(result.groups)}
        if refed:
            line["refed"] = refed
        if isinstance(plan, BatchPlan):
            samples = self.samples(plan, epoch, step, result.groups)
            for e, s, g in refed:
                samples += self.samples(plan, e, s, (g,))
            line["samples"] = sorted(samples)
        with self.record.open("a") as out:
            out.write(json.dumps(line) + "\n")

    def samples(self, plan: BatchPlan, epoch: int, step: int, groups: tuple[int, ...]) -> list[int]:
        """The dataset indices the `groups` trained at (epoch, step)."""
        perm, found = plan.permutation(epoch), []
        for group in groups:
            for rank in range(group * self.group_dp, (group + 1) * self.group_dp):
                for micro in dataclasses.replace(plan, dp_rank=rank).micro_batches(perm, step, epoch):
                    found.extend(i for i in micro if i >= 0)
        return found

    def truncate_after(self, step: int) -> None:
        truncate_jsonl(self.record, step)

    @property
    def writes(self) -> bool:
        """Whether this group writes the job's checkpoints now."""
        return self.replicas.writes

    def close(self) -> None:
        self.replicas.close()

    # -- what a recovering group receives -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a recovering peer receives. torchft calls it in its quorum and only logs an error; a state this
        group cannot give is a bug, not a passing fault, so the error is kept and this group's next quorum raises
        it (`ReplicaGroups.begin`) instead of every later quorum failing in the same way."""
        trainer = self.trainer
        try:
            states = trainer.checkpoint_manager.states()
            progress = {k: v for k, v in dataclasses.asdict(trainer.state).items() if k not in OWN_FIELDS}
            return {"model": states.model_state(), "optimizer": states.optimizer_state(),
                    "scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else {},
                    "progress": json.loads(json.dumps(progress))}
        except Exception as err:
            self.replicas.transport.failure = ReplicaGroupError(
                f"this group's state for a recovering peer could not be read ({type(err).__name__}: {err})")
            raise

    def load_state_dict(self, received: dict[str, Any]) -> None:
        from shardtrain.parallel.recovery import copy_into

        trainer = self.trainer
        states = trainer.checkpoint_manager.states()
        local = {"model": states.model_state(), "optimizer": states.optimizer_state()}
        copy_into(local, {"model": received["model"], "optimizer": received["optimizer"]}, "state")
        states.load_model_state(local["model"])
        states.load_optimizer_state(_with_values(local["optimizer"], received["optimizer"]))
        if trainer.lr_scheduler is not None:
            trainer.lr_scheduler.load_state_dict(received["scheduler"])
        for name, value in received["progress"].items():
            if hasattr(trainer.state, name) and name not in OWN_FIELDS:
                setattr(trainer.state, name, value)


def committed_steps(trainer: Any, record: Path | None = None) -> int:
    """The last step of the job's record in `trainer`'s output_dir (0: none), read by the group's rank 0 and
    shared with its ranks."""
    record = record if record is not None else Path(trainer.args.output_dir) / RECORD_FILE
    last = 0
    if trainer.rank == 0 and record.is_file():
        for line in record.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
    value = torch.tensor([last], dtype=torch.int64, device=trainer.runtime.device)
    trainer.runtime.backend.broadcast(value, src=0)
    return int(value.item())


def exit_finished(trainer: Any, step: int) -> None:
    """End a group that (re)started after the job finished: one line, exit status 0, nothing written."""
    if trainer.rank == 0:
        print(f"replica group {trainer.spec.fault_tolerance.replica_group}: the job finished at step {step} "
              f"(its record in {trainer.args.output_dir}); nothing to train", flush=True)
    raise SystemExit(0)


def check_replica_inputs(args: Any, plan: Plan, *, xla: bool) -> None:
    """What replica groups cannot run yet, refused before the first step with the reason.

    Raises:
        TrainingArgumentsError: a stream or a user's loader (the record needs indexed samples),
            auto_find_batch_size (a group's smaller batch is another layout), the XLA backend.
    """
    from shardtrain.errors import TrainingArgumentsError

    if not isinstance(plan, BatchPlan):
        raise TrainingArgumentsError("fault_tolerance needs an indexable train_dataset read by shardtrain's batch "
                                     "plan (the record of committed samples names dataset indices); a stream or "
                                     "an overridden get_train_dataloader cannot be used with replica groups")
    if args.auto_find_batch_size:
        raise TrainingArgumentsError("fault_tolerance with auto_find_batch_size: a group that cuts its batch would "
                                     "no longer match its peers; set per_device_train_batch_size instead")
    if xla:
        raise TrainingArgumentsError("fault_tolerance is not supported on the XLA backend (torchft's process "
                                     "groups are gloo and NCCL); remove fault_tolerance or fsdp_config's xla")


def _with_values(local: Any, received: Any) -> Any:
    """`local` (tensors filled already) with the received non-tensor values (learning rates, step counts)."""
    if isinstance(local, torch.Tensor):
        return local
    if isinstance(local, dict) and isinstance(received, dict):
        return {k: _with_values(v, received.get(k, v)) for k, v in local.items()} | \
            {k: v for k, v in received.items() if k not in local}
    if isinstance(local, list | tuple) and isinstance(received, list | tuple) and len(local) == len(received):
        return type(local)(_with_values(a, b) for a, b in zip(local, received))
    return received
