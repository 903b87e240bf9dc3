"""The training loop as one part: epochs and steps over the data plan, the step guard's replay and skips, the
batch-size retry, preemption and the end of a stream. The Trainer drives it through `LoopHooks`, as
`OptimizerStep` calls back through `StepHooks`:

    run = TrainingRun(state=trainer.state, guarded=guarded, logger=logger, rank=rank,
                      retry_on_oom=args.auto_find_batch_size)
    run.run(data, plan, max_steps, window, hooks)   # until max_steps, a callback's stop, or SIGTERM

Where the data stands is derived from the step (a plan with a known pass length) or kept in the state with it
(`data_epoch` / `data_step`: a stream, a loader without a length), so a resume starts at the next step's samples.

With replica groups a `StepGate` opens each step before its batches are read (the quorum; a group behind its
peers takes their state there, and the loop moves to the data position it received) and records each committed
step; a step the groups did not commit is read and run again.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import transformers
from transformers import TrainerControl
from transformers.trainer_callback import ExportableState
from transformers.trainer_pt_utils import get_model_param_count

from shardtrain.checkpoint.manager import CheckpointManager
from shardtrain.errors import DataError, print_line
from shardtrain.train.data.batch_plan import BatchPlan
from shardtrain.train.data.streaming import is_stream
from shardtrain.train.data.training_data import Plan, TrainingData
from shardtrain.train.data.user_loader import LoaderPlan
from shardtrain.train.metrics.logger import MetricsLogger
from shardtrain.train.state import TrainerState
from shardtrain.train.step.batch_finder import out_of_memory
from shardtrain.train.step.guard import GuardedRun
from shardtrain.train.step.optimizer_step import StepResult
from shardtrain.train.step.preemption import EXIT_CODE, Preempted
from shardtrain.train.step.step_flow import LossWindow


class LoopHooks(Protocol):
    """What the loop calls back into (the Trainer's side: callbacks, the step, logging, saving)."""

    @property
    def control(self) -> TrainerControl:
        """The callbacks' current `TrainerControl` (a callback may replace it)."""

    def fire(self, event: str) -> None:
        """A callback event (`on_epoch_begin`, `on_step_begin`, ...)."""

    def optimizer_step(self, batches: list[Any], placeholders: list[bool]) -> StepResult:
        """One optimizer step on this rank's micro-batches."""

    def log_evaluate_save(self, window: LossWindow, last: StepResult | None) -> None:
        """What the control flags ask for after a step or an epoch."""

    def log(self, logs: dict[str, float]) -> None:
        """A log entry (the step guard's skipped-step count)."""

    def smaller_batch(self, err: BaseException) -> tuple[TrainingData, Plan]:
        """`auto_find_batch_size`: drop the failed step's partial work, cut the per-device batch; the data and
        plan with the smaller micro-batches (the global batch is the same)."""

    def checkpoint_for_exit(self) -> None:
        """A complete checkpoint of the last finished step (unless one was just written), committed."""


class StepGate(Protocol):
    """Replica groups' side of the loop (`train.loop.replica_gate`)."""

    def begin(self, state: TrainerState) -> bool:
        """Before a step's batches are read; True when the state moved (recovered from a peer)."""

    def extend(self, data: TrainingData, plan: Plan, batches: list[Any], placeholders: list[bool]
               ) -> tuple[list[Any], list[bool]]:
        """The step's micro-batches with a lost share of an earlier step this rank re-feeds (if any)."""

    def committed(self, plan: Plan, epoch: int, step: int, result: StepResult) -> None:
        """After a committed step (the record of what was trained)."""


@dataclass(kw_only=True)
class TrainingRun:
    """One `train()`'s loop (see the module docstring).

    Args:
        state: the Trainer's state, advanced step by step.
        guarded: the step guard of this run (its recorded skips are replayed), or None.
        logger: metrics.jsonl and the throughput clock.
        rank: this process's rank (rank 0 prints).
        output_dir: where checkpoints go (named in the preemption's line).
        retry_on_oom: `auto_find_batch_size`: a step that runs out of memory is run again with smaller parts.
        gate: the replica groups' gate (None: no replica groups).
    """

    state: TrainerState
    guarded: GuardedRun | None
    logger: MetricsLogger
    rank: int
    output_dir: str = "."
    retry_on_oom: bool = False
    gate: StepGate | None = None
    _moved: bool = field(default=False, init=False)  # the gate's recovery ended the pass's steps early

    def run(self, data: TrainingData, plan: Plan, max_steps: int, window: LossWindow, hooks: LoopHooks) -> None:
        """Train until `max_steps` or a callback stops it. Ctrl-C exits 130 with a line; SIGTERM on any rank
        writes a checkpoint of the last finished step and exits 143 (`Preempted`)."""
        try:
            self._loop(data, plan, max_steps, window, hooks)
        except KeyboardInterrupt:
            if self.rank == 0:
                print(f"error: interrupted at step {self.state.global_step}; resume with "
                      f"resume_from_checkpoint='auto'", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except Preempted as preempted:
            hooks.checkpoint_for_exit()
            if self.rank == 0:
                print(f"warning: {preempted}; wrote {self.output_dir}/checkpoint-{self.state.global_step}, exiting "
                      f"{EXIT_CODE}; a restart resumes from it", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CODE) from None

    def _loop(self, data: TrainingData, plan: Plan, max_steps: int, window: LossWindow, hooks: LoopHooks) -> None:
        state = self.state
        last: StepResult | None = None  # the newest step (a log entry reports its grad norm and learning rate)
        # the same pass goes on (no second epoch begin): auto_find_batch_size cut the batch, the replica groups
        # did not commit a step, or a recovery moved the data position
        shrunk = False
        while state.global_step < max_steps and not hooks.control.should_training_stop:
            epoch, start = self._position(plan)
            if not shrunk:
                hooks.control.should_epoch_stop = False
                hooks.fire("on_epoch_begin")
            shrunk = self._moved = False
            for step, (batches, placeholders) in enumerate(self._steps(data, plan, epoch, start), start):
                if self.guarded is not None and self.guarded.is_recorded(epoch, step):  # skipped before a resume
                    self.guarded.pass_recorded(state, epoch, step)
                    state.data_epoch, state.data_step = epoch, step + 1
                    continue
                try:
                    if self.gate is not None:
                        batches, placeholders = self.gate.extend(data, plan, batches, placeholders)
                    hooks.fire("on_step_begin")
                    result = hooks.optimizer_step(batches, placeholders)
                    if not result.committed:
                        shrunk = True
                        break
                    if result.skipped is not None:
                        self._skip(result.skipped, plan, epoch, step, hooks)
                        continue
                    last = result
                    self._advance(plan, epoch, step, result, window)
                    if self.gate is not None:
                        self.gate.committed(plan, epoch, step, result)
                    hooks.fire("on_step_end")
                except Exception as err:
                    if not (self.retry_on_oom and out_of_memory(err)) or isinstance(plan, LoaderPlan):
                        raise
                    data, plan = hooks.smaller_batch(err)  # the same step again, with smaller parts
                    shrunk = True
                    break
                hooks.log_evaluate_save(window, last)
                control = hooks.control
                if state.global_step >= max_steps or control.should_training_stop or control.should_epoch_stop:
                    break
            else:  # the pass is over (or a recovery moved the data)
                if self._moved:
                    shrunk = True
                    continue
                if not plan.steps_per_epoch and state.data_step == 0 and start == 0:
                    raise DataError(plan.nothing_read)
                state.data_epoch, state.data_step = epoch + 1, 0
            if shrunk:
                continue
            hooks.fire("on_epoch_end")
            hooks.log_evaluate_save(window, last)  # what on_epoch_end asked for (epoch strategies)
        if window:  # steps after the last log entry: in train_loss, as under Hugging Face
            window.fold()

    def _steps(self, data: TrainingData, plan: Plan, epoch: int, start: int) -> Any:
        """The pass's steps from `start`, each opened by the gate before its batches are read; ends early (with
        `_moved` set) when the gate's recovery moved the data position."""
        steps = data.epoch_steps(plan, epoch, start)
        while True:
            if self.gate is not None and self.gate.begin(self.state):
                self._moved = True
                return
            item = next(steps, None)
            if item is None:
                return
            yield item

    def _position(self, plan: Plan) -> tuple[int, int]:
        """(pass, step in it) of the next step: derived from the step, or kept with it (a pass of unknown length)."""
        if not plan.steps_per_epoch:
            return self.state.data_epoch, self.state.data_step
        return divmod(self.state.global_step + self.state.skipped_steps, plan.steps_per_epoch)

    def _advance(self, plan: Plan, epoch: int, step: int, result: StepResult, window: LossWindow) -> None:
        state = self.state
        state.global_step += 1
        state.data_epoch, state.data_step = epoch, step + 1
        # a pass of unknown length: the passes completed
        state.epoch = state.global_step / plan.steps_per_epoch if plan.steps_per_epoch else float(epoch)
        window.add(result.loss_sum, result.tokens)
        if self.guarded is not None:
            state.guard_window = self.guarded.guard.state()
        self.logger.step_done(state.num_input_tokens_seen)

    def _skip(self, reason: str, plan: Plan, epoch: int, step: int, hooks: LoopHooks) -> None:
        """The step guard skipped this step (every rank alike): record it, say so, move the data on; too many in
        a row stop the run (StepGuardError) with the checkpoints as they are."""
        samples = None
        if isinstance(plan, BatchPlan):
            size = plan.global_batch_size
            samples = [i for i in plan.permutation(epoch)[step * size:(step + 1) * size] if i >= 0]
        line = self.guarded.skip(self.state, reason, epoch, step, samples)
        self.state.data_epoch, self.state.data_step = epoch, step + 1
        if self.rank == 0:
            print_line(f"warning: {line}")
        hooks.log({"skipped_steps": self.state.skipped_steps})
        saved = CheckpointManager.list_checkpoints(self.output_dir)
        self.guarded.guard.skipped(self.state.global_step, reason, saved[-1].name if saved else None)


def first_state(args: Any, plan: Plan, max_steps: int, *, rank: int, train_batch_size: int,
                stateful: list[Any]) -> TrainerState:
    """The `TrainerState` a run starts from (a resume replaces it with the saved one): Hugging Face's fields, the
    intervals resolved against `max_steps`, the `ExportableState` objects among `stateful` (callbacks, control)."""
    return TrainerState(max_steps=max_steps, steps_per_epoch=plan.steps_per_epoch,
                        global_batch_size=plan.global_batch_size, epoch=0.0,
                        num_train_epochs=math.ceil(max_steps / (plan.steps_per_epoch or max_steps)),
                        train_batch_size=train_batch_size, logging_steps=args.interval("logging_steps", max_steps),
                        eval_steps=args.interval("eval_steps", max_steps),
                        save_steps=args.interval("save_steps", max_steps),
                        is_local_process_zero=args.local_process_index == 0, is_world_process_zero=rank == 0,
                        total_flos=0.0, stateful_callbacks=[c for c in stateful if isinstance(c, ExportableState)])


def log_training_plan(args: Any, plan: Plan, max_steps: int, *, dataset: Any, model: Any) -> None:
    """Hugging Face's "***** Running training *****" block, on its logger (`log_level`)."""
    log = transformers.utils.logging.get_logger("transformers.trainer")
    steps_per_epoch = plan.steps_per_epoch
    log.info("***** Running training *****")
    if not is_stream(dataset):
        log.info(f"  Num examples = {len(dataset):,}")
    log.info(f"  Num Epochs = {math.ceil(max_steps / (steps_per_epoch or max_steps)):,}")
    log.info(f"  Num update steps per epoch = {steps_per_epoch:,}")
    log.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
    log.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {plan.global_batch_size:,}")
    # (the plan's: a pipeline an automatic layout chose takes more of them, for the same global batch)
    log.info(f"  Gradient Accumulation steps = {getattr(plan, 'accumulation_steps', args.gradient_accumulation_steps)}")
    log.info(f"  Total optimization steps = {max_steps:,}")
    log.info(f"  Number of trainable parameters = {get_model_param_count(model, trainable_only=True):,}")
