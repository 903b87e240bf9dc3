"""What a pipeline costs, on paper: the schedule's bubble (the share of a step a rank waits) and the memory of a
rank (its stages' share of the model's state, and the activations of the microbatches it holds in flight).

    bubble_fraction("1F1B", stages=4, microbatches=8)          # (p - 1) / (m + p - 1) = 0.273
    in_flight("GPipe", stages=4, microbatches=8, stage=0)      # GPipe keeps every microbatch: 8
    stage_state_bytes(param_numel, dp=2, optimizer_slots=2)    # params + grads + AdamW's 2 slots, fp32, sharded

`stages` is the pipeline's ranks (p); the schedules of two stages per rank (v = 2) count a rank's work as the
sum of its two stages. GPipe and 1F1B leave a rank idle (p - 1) / (m + p - 1) of the schedule with m
microbatches; 1F1B holds fewer microbatches' activations (at most p - rank in flight, rank 0 the most), GPipe all
m. Interleaved 1F1B and looped BFS cut the fill to (p - 1) / (v m + p - 1). The zero-bubble schedules
(InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) split each backward into an input and a weight pass and run the
weight passes in what would be the drain, so what stays idle is the fill of the forward passes: with the three
passes taking the same time (the papers' assumption) (p - 1) / (3 v m + p - 1). More microbatches shrink the
bubble and each microbatch, so the kernels get smaller: choose m >= 4p where the microbatch still fills the device.
"""

from __future__ import annotations

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
    chunks = _per_rank(schedule) * microbatches * (3 if schedule in ZERO_BUBBLE else 1)
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
