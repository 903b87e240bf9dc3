"""What a pipeline costs, on paper: the schedule's bubble (the share of a step a stage waits) and the memory of a
stage (its share of the model's state, and the activations of the microbatches it holds in flight).

    bubble_fraction("1F1B", stages=4, microbatches=8)          # (p - 1) / (m + p - 1) = 0.273
    in_flight("GPipe", stages=4, microbatches=8, stage=0)      # GPipe keeps every microbatch: 8
    stage_state_bytes(param_numel, dp=2, optimizer_slots=2)    # params + grads + AdamW's 2 slots, fp32, sharded

GPipe and 1F1B have the same bubble, (p - 1) / (m + p - 1) of the schedule for p stages and m microbatches; 1F1B
holds fewer microbatches' activations (at most p - stage in flight, stage 0 the most), GPipe all m. More
microbatches shrink the bubble and each microbatch, so the kernels get smaller: choose m >= 4p where the
microbatch still fills the device.
"""

from __future__ import annotations

from shardtrain.errors import PlanError

FILL_DRAIN = ("GPipe", "1F1B")


def bubble_fraction(schedule: str, *, stages: int, microbatches: int) -> float:
    """The share of a schedule's time a stage is idle, for balanced stages (fill and drain of the pipeline).

    Raises:
        PlanError: a schedule this estimate does not cover.
    """
    if schedule not in FILL_DRAIN:
        raise PlanError(f"no bubble estimate for pp_schedule {schedule!r}; the estimate covers {list(FILL_DRAIN)}")
    return (stages - 1) / (microbatches + stages - 1)


def in_flight(schedule: str, *, stages: int, microbatches: int, stage: int) -> int:
    """Microbatches whose activations stage `stage` holds at its peak (their forward done, backward not)."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(stages - stage, microbatches)
    raise PlanError(f"no in-flight estimate for pp_schedule {schedule!r}; the estimate covers {list(FILL_DRAIN)}")


def stage_state_bytes(param_numel: int, *, dp: int, optimizer_slots: int = 2, bytes_per_value: int = 4) -> int:
    """A rank's bytes of its stage's parameters, gradients and optimizer slots, sharded over `dp` ranks."""
    return -(-param_numel // dp) * bytes_per_value * (2 + optimizer_slots)
