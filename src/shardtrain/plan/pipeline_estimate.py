"""What a pipeline costs, on paper: the schedule's bubble (the share of a step a rank waits) and the memory of a
rank (its stages' share of the model's state, and the activations of the microbatches it holds in flight).

    bubble_fraction("1F1B", stages=4, microbatches=8)          # (p - 1) / (m + p - 1) = 0.273
    in_flight("GPipe", stages=4, microbatches=8, stage=0)      # GPipe keeps every microbatch: 8
    stage_state_bytes(param_numel, dp=2, optimizer_slots=2)    # params + grads + AdamW's 2 slots, fp32, sharded
    idle_shares({0: ["0F0", "0F1", "0B0", ...], 1: [...]}, stages=2)   # a schedule's own action table, played

`stages` is the pipeline's ranks (p); the schedules of two stages per rank (v = 2) count a rank's work as the
sum of its two stages. GPipe and 1F1B leave a rank idle (p - 1) / (m + p - 1) of the schedule with m
microbatches; 1F1B holds fewer microbatches' activations (at most p - rank in flight, rank 0 the most), GPipe all
m. Interleaved 1F1B and looped BFS cut the fill to (p - 1) / (v m + p - 1). The zero-bubble schedules split each
backward into an input and a weight pass and run the weight passes in what would be the drain; with the three
passes taking the same time (the papers' assumption): InterleavedZeroBubble (p - 1) / (3 v m + p - 1), ZB-V the
same from m = 2p on (below, (p - 1) / (3 m + p - 1)), DualPipeV (p - 1) / (3 m + p - 1) (it runs a rank's two
stages' forward and backward passes in pairs). Those are what torch 2.13's own tables of the schedules give when
played with passes of equal time (`idle_shares`), checked for p = 2 and 4 against the tables of the running
schedules (`tests/distributed/test_pipeline.py`). More microbatches shrink the bubble and each microbatch, so
the kernels get smaller: choose m >= 4p where the microbatch still fills the device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardtrain.errors import PlanError

FILL_DRAIN = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MODELLED = (*FILL_DRAIN, *LOOPED, *ZERO_BUBBLE)


def _per_rank(schedule: str) -> int:
    if schedule not in MODELLED:
        raise PlanError(f"no estimate for pp_schedule {schedule!r}; the estimates cover {list(MODELLED)}")
    return 1 if schedule in FILL_DRAIN else 2


def bubble_fraction(schedule: str, *, stages: int, microbatches: int) -> float:
    """The share of a schedule's time a rank is idle, for balanced stages (see the module docstring).

    Raises:
        PlanError: a schedule this estimate does not cover.
    """
    chunks = _per_rank(schedule) * microbatches
    if schedule == "DualPipeV" or (schedule == "ZBVZeroBubble" and microbatches < 2 * stages):
        chunks = 3 * microbatches
    elif schedule in ZERO_BUBBLE:
        chunks *= 3
    return (stages - 1) / (chunks + stages - 1)


def in_flight(schedule: str, *, stages: int, microbatches: int, stage: int) -> int:
    """Microbatches (of the rank's whole work: both its stages under a schedule of two per rank) whose activations
    pipeline rank `stage` holds at its peak (their forward done, backward not): GPipe and looped BFS all of them,
    1F1B p - rank, the interleaved ones torch's warm-up of `(v - 1) min(m, p) + 2 (p - 1 - rank) + 1` stage
    chunks, the V-shaped ones p (ZB-V keeps 1F1B's peak on every rank) and DualPipeV one more."""
    per_rank = _per_rank(schedule)
    if schedule in ("GPipe", "LoopedBFS"):
        held = microbatches
    elif schedule == "1F1B":
        held = stages - stage
    elif schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        chunks = (per_rank - 1) * min(microbatches, stages) + 2 * (stages - 1 - stage) + 1
        held = -(-chunks // per_rank)
    else:  # the V: ZBVZeroBubble, DualPipeV
        held = stages + (schedule == "DualPipeV")
    return min(held, microbatches)


def stage_state_bytes(param_numel: int, *, dp: int, optimizer_slots: int = 2, bytes_per_value: int = 4) -> int:
    """A rank's bytes of its stage's parameters, gradients and optimizer slots, sharded over `dp` ranks."""
    return -(-param_numel // dp) * bytes_per_value * (2 + optimizer_slots)


# one compute action of torch's schedule tables, as `_Action` writes it: stage, pass, microbatch ("3I0"), or two
# run together ("(0F3;3B1)OVERLAP_F_B", DualPipeV's)
_ACTION = re.compile(r"(\d+)([FIWB])(\d+)")
# the passes' durations in forward passes: a full backward is twice a forward, split into input and weight passes
_PASS_TIME = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


def fill_drain_table(schedule: str, *, stages: int, microbatches: int) -> dict[int, list[str]]:
    """GPipe's or 1F1B's action table (torch builds none for one stage per rank), written as torch writes the
    tables of the others: rank r's forwards ("rFi") and full backwards ("rBi") in order. 1F1B: p - r forwards
    first, then a backward and a forward in turn."""
    table = {}
    for rank in range(stages):
        warmup = microbatches if schedule == "GPipe" else min(stages - rank, microbatches)
        order = [f"{rank}F{i}" for i in range(warmup)]
        for i in range(microbatches):
            order.append(f"{rank}B{i}")
            if warmup + i < microbatches:
                order.append(f"{rank}F{warmup + i}")
        table[rank] = order
    return table


@dataclass(frozen=True)
class Played:
    """A schedule's table played (`play`): when each rank finishes its last pass, and its time in passes."""

    finish: dict[int, float]
    busy: dict[int, float]

    @property
    def step(self) -> float:
        return max(self.finish.values())

    def idle_shares(self) -> dict[int, float]:
        return {rank: 1 - busy / self.step for rank, busy in self.busy.items()}


def idle_shares(order: Mapping[int, Sequence[str | None]], *, stages: int,
                durations: Mapping[tuple[int, str], float] | None = None) -> dict[int, float]:
    """Each rank's idle share of a schedule's step: `play(order, stages=..., durations=...).idle_shares()`. With
    the default durations, for GPipe and 1F1B it comes to (p - 1) / (m + p - 1), and for every schedule to
    `bubble_fraction`."""
    return play(order, stages=stages, durations=durations).idle_shares()


def play(order: Mapping[int, Sequence[str | None]], *, stages: int,
         durations: Mapping[tuple[int, str], float] | None = None) -> Played:
    """A schedule's action table played as the ranks would run it (torch's `pipeline_order`, or
    `fill_drain_table`: per rank, its actions in order, as `str(_Action)`; None and communication entries are
    skipped), messages taking no time and each pass `durations[(stage, pass)]` (pass "F", "I", "W" or "B"), by
    default every stage's the same: a forward 1, a full backward 2, its input and weight passes 1 each. An action
    starts when its rank is free and what it needs is done (a forward: the previous stage's forward of the
    microbatch; a backward or input pass: the next stage's; a weight pass: its own input pass); what is left of
    the step beside a rank's passes is its bubble.

    Raises:
        PlanError: a table that cannot run (an action waits on one that never comes).
    """
    queues = {rank: [(str(a), _ACTION.findall(str(a))) for a in actions if a is not None]
              for rank, actions in order.items()}
    queues = {rank: [(text, parts) for text, parts in q if parts] for rank, q in queues.items()}
    done: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    position = dict.fromkeys(queues, 0)

    def ready_at(stage: int, kind: str, microbatch: int) -> float | None:
        needs = {"F": [(stage - 1, "F")] if stage > 0 else [],
                 "W": [(stage, "I")]}.get(kind, [(stage + 1, "I")] if stage < stages - 1 else [(stage, "F")])
        times = []
        for need_stage, need_kind in needs:
            kinds = ("I", "B") if need_kind == "I" else (need_kind,)
            found = [done[(need_stage, k, microbatch)] for k in kinds if (need_stage, k, microbatch) in done]
            if not found:
                return None
            times.append(min(found))
        return max(times, default=0.0)

    progressed = True
    while progressed:
        progressed = False
        for rank, queue in queues.items():
            while position[rank] < len(queue):
                passes = [(int(st), kind, int(mb)) for st, kind, mb in queue[position[rank]][1]]
                starts = [ready_at(*p) for p in passes]
                if any(t is None for t in starts):
                    break
                start = max([free[rank], *starts])
                took = sum(_PASS_TIME[kind] if durations is None else durations[(stage, kind)]
                           for stage, kind, _ in passes)
                for p in passes:
                    done[p] = start + took
                free[rank], busy[rank] = start + took, busy[rank] + took
                position[rank] += 1
                progressed = True
    stuck = {rank: queue[position[rank]][0] for rank, queue in queues.items() if position[rank] < len(queue)}
    if stuck:
        raise PlanError(f"the schedule's table cannot run: ranks {sorted(stuck)} wait at "
                        f"{', '.join(f'{action} (rank {rank})' for rank, action in sorted(stuck.items()))}")
    return Played(finish=free, busy=busy)
