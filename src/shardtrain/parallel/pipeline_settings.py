"""A pipeline's settings, resolved once (`PipelineSettings`: the schedule, its microbatches, the layers per stage)
and checked with the numbers in the error (`check_settings`), before any process group starts: what the planner,
the launcher's preflight and the runtime read; `pipeline.py` builds the stages and the schedule from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtrain.errors import PipelineError

# the schedules of torch.distributed.pipelining, by the names `pp_schedule` takes
SCHEDULES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
             "LoopedBFS": "ScheduleLoopedBFS", "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
             "ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
SINGLE_STAGE = ("GPipe", "1F1B")
# schedules that split each backward into an input-gradient and a weight-gradient pass
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# schedules whose rank r holds stages r and 2 pp - 1 - r (a "V": the first and the last stage on rank 0)
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
STAGES_PER_RANK = 2  # of a multi-stage schedule


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """`pp_schedule`, `pp_microbatches` (None: as many microbatches as stages) and `pp_layers` (decoder layers
    per stage, in stage order; None: an even split)."""

    schedule: str = "1F1B"
    microbatches: int | None = None
    layers: tuple[int, ...] | None = None

    @classmethod
    def of(cls, settings: Any) -> PipelineSettings:
        """From the `pp_schedule`, `pp_microbatches` and `pp_layers` of `TrainingArguments` or a `RunSpec`."""
        layers = getattr(settings, "pp_layers", None)
        return cls(schedule=settings.pp_schedule, microbatches=settings.pp_microbatches,
                   layers=tuple(layers) if layers is not None else None)

    def microbatches_for(self, pp: int) -> int:
        """`microbatches`, or as many as the pipeline over `pp` ranks has stages."""
        return self.stage_count(pp) if self.microbatches is None else self.microbatches

    @property
    def multi_stage(self) -> bool:
        return self.schedule not in SINGLE_STAGE

    def stage_count(self, pp: int) -> int:
        """The pipeline's stages over `pp` ranks."""
        return pp * (STAGES_PER_RANK if self.multi_stage else 1)

    def local_stages(self, pp_rank: int, pp: int) -> tuple[int, ...]:
        """The stages rank `pp_rank` of `pp` holds, in schedule order."""
        if not self.multi_stage:
            return (pp_rank,)
        if self.schedule in V_SHAPED:
            return (pp_rank, 2 * pp - 1 - pp_rank)
        return tuple(pp_rank + k * pp for k in range(STAGES_PER_RANK))

    @property
    def ends_apart(self) -> bool:
        """Whether the first and the last stage are on two ranks (all but the V-shaped schedules)."""
        return self.schedule not in V_SHAPED


def check_settings(settings: PipelineSettings, *, pp: int, per_device_batch: int | None = None,
                   compiled: bool = False) -> None:
    """Refuse a schedule or microbatch count a pipeline over `pp` ranks cannot run, with the numbers.

    Raises:
        PipelineError: an unknown schedule, microbatches < 1, fewer microbatches than 1F1B needs (pp) or
            DualPipeV needs (its 2 pp stages), a looped schedule's microbatches that are not a multiple of pp, a
            micro-batch that does not split into the microbatches, or a zero-bubble schedule with `torch_compile`
            (`compiled`), which torch does not run.
    """
    from shardtrain.config.values import closest

    if settings.schedule not in SCHEDULES:
        raise PipelineError(f"pp_schedule = {settings.schedule!r} is not a schedule; use one of {list(SCHEDULES)}"
                            f"{closest(settings.schedule, list(SCHEDULES))}")
    if compiled and settings.schedule in SPLIT_BACKWARD:
        raise PipelineError(f"pp_schedule = {settings.schedule!r} with torch_compile: torch.distributed.pipelining "
                            "does not split the backward of a compiled stage into its input and weight passes; set "
                            "torch_compile=False, or use 'Interleaved1F1B' or '1F1B'")
    count = settings.microbatches_for(pp)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PipelineError(f"pp_microbatches = {settings.microbatches!r} must be an int >= 1")
    least = {"1F1B": pp, "DualPipeV": 2 * pp}.get(settings.schedule, 1)
    if count < least:
        raise PipelineError(f"pp_microbatches = {count} is fewer than the {least} {settings.schedule} needs over "
                            f"pp_size = {pp} ranks; set pp_microbatches >= {least}, or pp_schedule 'GPipe'")
    if settings.multi_stage and count % pp:
        raise PipelineError(f"pp_microbatches = {count} is not a multiple of pp_size = {pp}, which "
                            f"{settings.schedule} runs in rounds of; set it to {pp * -(-count // pp)}")
    if settings.layers is not None:
        stages = settings.stage_count(pp)
        if len(settings.layers) != stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                 for n in settings.layers):
            raise PipelineError(f"pp_layers = {list(settings.layers)} must give each of the {stages} pipeline "
                                f"stages (pp_size {pp}{' x 2 per rank' if stages > pp else ''}) a number of "
                                "layers >= 1, in stage order")
    if per_device_batch is not None and per_device_batch % count:
        raise PipelineError(
            f"per_device_train_batch_size = {per_device_batch} does not split into pp_microbatches = {count} equal "
            f"microbatches; make the batch a multiple of {count} (e.g. {count * max(1, per_device_batch // count)}) "
            "or choose pp_microbatches among its divisors")
