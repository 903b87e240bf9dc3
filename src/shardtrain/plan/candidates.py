"""The candidate layouts `"layout": "auto"` chooses among, and what each costs: rank 0 traces every candidate's
step (`shardtrain.plan`, fake tensors) for its peak memory, FLOPs, bytes on the wire per collective kind,
collective calls and ops; `Candidate.step_s` turns those into a predicted step at measured rates. The choice itself
is `plan.auto_layout`; `plan.fresh_process` runs `trace_candidates` in a child when the process group is up.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import FSDPConfigError, PlanError
from shardtrain.plan.calibration import Rates

# "no_shard_one_unit": plain data parallel with the whole model as one FSDP unit (one all-reduce per step, as one
# DDP bucket, nothing of it overlapped; no per-unit hooks): offered on CPU, where it was measured (a 0.8M Llama: 34 ms
# against 49 per layer; 50M: 924 against 716); not on GPUs, where it has not been. Activation checkpointing needs
# per-layer units, so it comes with AC none only.
SHARDINGS = ("no_shard", "shard_grad_op", "full_shard", "no_shard_one_unit")
ONE_UNIT = "no_shard_one_unit"
AC_VALUES: dict[str, bool | str] = {"none": False, "selective": "selective", "full": True}
BACKWARD_REDUCTIONS = ("reduce_scatter", "allreduce")  # gradient reductions (the norm's all-reduce is 8 bytes)
PIPELINE = 2  # the pipeline size a "layout": "auto" run may choose (pp 2 x dp world / 2)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout: its sharding, activation checkpointing and loss chunk (tokens; 0: off), its pipeline size (pp > 1:
    the schedule's `bubble`, and the activations sent between the stages, `p2p_bytes`), and what it costs."""

    sharding: str
    ac: str
    loss_chunk: int
    peak: int
    flops: float
    wire_bytes: float
    ops: int = 0
    collective_calls: int = 0
    selective_ops: int = 0
    wire_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    units: int = 1  # FSDP units, the root included
    pp: int = 1
    bubble: float = 0.0
    p2p_bytes: float = 0.0

    @property
    def name(self) -> str:
        """E.g. "full_shard, AC selective, loss chunk off", "pp 2, full_shard, AC none, loss chunk off" (the
        table's and the benchmark's key)."""
        pipeline = f"pp {self.pp}, " if self.pp > 1 else ""
        return f"{pipeline}{self.sharding}, AC {self.ac}, loss chunk {self.loss_chunk or 'off'}"

    def step_s(self, rates: Rates) -> float:
        """Predicted seconds per step: compute, bytes on the wire, a round trip per collective, host time per op
        (more under selective checkpointing's Python policy). Only the gradient reductions count as overlapped,
        all but the last unit's share (1/n of n units' is exposed): on GPUs FSDP2 runs them in its own stream while
        the backward goes on. On gloo torch 2.13's FSDP2 waits for each reduction, so there the 1/n is a fit to
        measurements, not an overlap: per-layer units measured faster than one unit (the 50M Llama here: no_shard
        per layer 716 ms a step, as one unit 924 ms), which the plain sum predicted the other way round. A
        pipeline's rank also sends activations to its neighbour (at the all-gather's rate) and idles for the
        schedule's bubble: its busy time is divided by 1 - bubble."""
        wire = self.wire_by_kind or {"other": self.wire_bytes}
        exposed = {kind: 1 / max(self.units, 1) for kind in BACKWARD_REDUCTIONS}
        busy = (self.flops / rates.flops_per_s
                + sum(sent * exposed.get(kind, 1.0) / rates.link_rate(kind) for kind, sent in wire.items())
                + self.p2p_bytes / rates.link_rate("p2p")
                + self.collective_calls * rates.s_per_collective + self.ops * rates.s_per_op
                + self.selective_ops * rates.s_per_selective_op)
        return busy / (1 - self.bubble)

    def apply(self, config: FSDPConfig, sharding: bool = True) -> FSDPConfig:
        """`config` with this candidate's activation checkpointing and (`sharding`) its sharding."""
        return layout_config(config, self.sharding if sharding else None, self.ac)


def layout_config(config: FSDPConfig, sharding: str | None, ac: str) -> FSDPConfig:
    """`config` with activation checkpointing `ac` (one of `AC_VALUES`) and, unless None, sharding `sharding` (one
    of `SHARDINGS`)."""
    changed = dataclasses.replace(config, activation_checkpointing=AC_VALUES[ac])
    if sharding is None:
        return changed
    changed = dataclasses.replace(changed, sharding_strategy=None, replicate_only=False,
                                  reshard_after_forward=sharding == "full_shard")
    if sharding in ("no_shard", ONE_UNIT):
        changed.apply_sharding_strategy("no_shard")
    if sharding == ONE_UNIT:
        changed = dataclasses.replace(changed, auto_wrap_policy="NO_WRAP")
    return changed


@dataclass(frozen=True, kw_only=True)
class Request:
    """What the planner needs about the run, read once from the Trainer's arguments and data."""

    world_size: int
    sizes: dict[str, int]
    per_device_batch: int
    seq_len: int
    gradient_accumulation_steps: int
    mixed_precision: str  # the run's: "bf16", "fp16" or "no"
    target: str
    choose_sharding: bool
    choose_ac: bool
    choose_loss_chunk: bool
    loss_chunk_setting: int | str | None = None
    choose_units: bool = False  # offer no_shard_one_unit (CPU, the wrap policy not set)
    # offer a pipeline of PIPELINE stages (the same global batch: PIPELINE x the accumulation steps over world /
    # PIPELINE data-parallel ranks), with the run's schedule and microbatches
    choose_pp: bool = False
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The matmuls' dtype under the run's mixed precision (what the compute rate is timed in, as `plan`)."""
        from shardtrain.plan.step_time import COMPUTE_DTYPES

        return COMPUTE_DTYPES.get(self.mixed_precision, torch.float32)

    @property
    def tokens(self) -> int:
        """Tokens one rank's micro-batch holds (context parallelism splits each sequence)."""
        return self.per_device_batch * self.seq_len // self.sizes.get("cp", 1)


def request_for(spec: Any, args: Any, train_dataset: Any, device_type: str, can_pipeline: bool = False) -> Request:
    """The planning request of a Trainer run: which keys the user left free, and the step's shape. `can_pipeline`:
    the Trainer's loss is the engine's token cross entropy (no custom loss or prediction step), which a pipeline
    computes on its last stage; a pipeline is then offered to a plain data-parallel run that did not set pp_size
    (the model's pipeline plan is checked when it is traced).

    Raises:
        FSDPConfigError: the sequence length cannot be read from `train_dataset`.
    """
    config: FSDPConfig = spec.fsdp
    given = config.given
    sizes = {k: v for k, v in spec.sizes.items() if v}
    # no_shard and the sharding choice are for plain data parallelism: other sizes keep the sharding as given
    plain_dp = not any(sizes.get(k, 1) > 1 for k in ("cp", "tp", "ep", "dp_shard", "dp_replicate")) \
        and not config.hybrid
    pipeline = {}
    if can_pipeline and plain_dp and "pp" not in sizes and spec.world_size % PIPELINE == 0 \
            and spec.fault_tolerance is None and not args.torch_compile \
            and args.per_device_train_batch_size % (args.pp_microbatches or PIPELINE) == 0:
        pipeline = {"choose_pp": True, "pp_schedule": args.pp_schedule, "pp_microbatches": args.pp_microbatches}
    return Request(world_size=spec.world_size, sizes=sizes, per_device_batch=args.per_device_train_batch_size,
                   seq_len=_seq_len(train_dataset), gradient_accumulation_steps=args.gradient_accumulation_steps,
                   mixed_precision=spec.mixed_precision, target="cpu" if device_type == "cpu" else "cuda",
                   choose_sharding=not ({"sharding_strategy", "reshard_after_forward"} & given) and plain_dp,
                   choose_ac="activation_checkpointing" not in given and not args.gradient_checkpointing,
                   choose_loss_chunk=args.loss_chunk_size is None, loss_chunk_setting=args.loss_chunk_size,
                   choose_units=device_type == "cpu" and "auto_wrap_policy" not in given, **pipeline)


def _seq_len(dataset: Any, samples: int = 64) -> int:
    """The longest `input_ids` among the first samples (the batches the step will see are padded to about that)."""
    lengths = []
    try:
        for index in range(min(samples, len(dataset))):
            ids = dataset[index]["input_ids"]
            lengths.append(len(ids))
    except (TypeError, KeyError, IndexError):
        lengths = []
    if not lengths:
        raise FSDPConfigError("fsdp_config 'layout': \"auto\" reads the sequence length from the train dataset's "
                              "'input_ids', and this train_dataset has none; pass a tokenized train_dataset or set "
                              "the layout by hand ('layout': \"manual\"; `shardtrain plan` predicts each one)")
    return max(lengths)


def trace_candidates(model: Any, config: FSDPConfig, request: Request
                     ) -> tuple[list[Candidate], tuple[int, int, int] | None]:
    """Trace every candidate layout's step (rank 0, before any process group): peak, FLOPs and wire bytes of
    each, and the step's largest matmul shape (what the compute rate is measured on)."""
    from shardtrain.plan.memory import device_peak
    from shardtrain.plan.planner import plan

    offered = {"no_shard": request.world_size > 1,  # one rank: nothing to replicate over
               ONE_UNIT: request.world_size > 1 and request.choose_units
               and (request.choose_ac or config.ac_mode == "none")}
    shardings = [s for s in SHARDINGS if offered.get(s, True)] if request.choose_sharding else [None]
    chunks = [None, "auto"] if request.choose_loss_chunk and _chunking_helps(model, request) \
        else [None if request.choose_loss_chunk else request.loss_chunk_setting]
    found: dict[tuple[str, str, int], Candidate] = {}
    gemm = None
    # the run's mixed precision (bf16 or fp16, from TrainingArguments or fsdp_config) as plan() reads it
    precision = None if request.mixed_precision == "no" else request.mixed_precision
    manual = dataclasses.replace(config, layout=None, max_memory_per_rank=None, mixed_precision=precision)
    for sharding, chunk in itertools.product(shardings, chunks):
        base = layout_config(manual, sharding, "none" if sharding == ONE_UNIT else manual.ac_mode)
        try:
            result = plan(model, fsdp_config=base, world_size=request.world_size, **request.sizes,
                          per_device_batch=request.per_device_batch, seq_len=request.seq_len,
                          gradient_accumulation_steps=request.gradient_accumulation_steps,
                          target=request.target, loss_chunk_size=chunk, estimate_step_time=False,
                          what_if=request.choose_ac and sharding != ONE_UNIT)
        except PlanError as err:
            raise FSDPConfigError(f"fsdp_config 'layout': \"auto\" could not plan this run: {err}; set the layout "
                                  "by hand ('layout': \"manual\")") from None
        label = sharding or sharding_label(base)
        gemm = gemm or result.trace.gemm
        for mode, trace in result.ac_traces.items():
            # "auto" may come to no chunking (a small vocabulary) or one chunk of every token: the same layout
            chunk_tokens = trace.loss_chunk_size if 0 < trace.loss_chunk_size < request.tokens else 0
            key = (label, mode, chunk_tokens)
            if key not in found:
                found[key] = Candidate(sharding=label, ac=mode, loss_chunk=chunk_tokens,
                                       peak=device_peak(trace, base.cpu_offload, request.target),
                                       flops=trace.flops, wire_bytes=trace.wire_bytes, ops=trace.ops,
                                       collective_calls=trace.collective_calls, selective_ops=trace.selective_ops,
                                       wire_by_kind=dict(trace.wire_by_kind), units=len(trace.units))
    if request.choose_pp:
        for chunk in chunks:
            found.update(_pipeline_candidates(model, manual, request, chunk))
    return list(found.values()), gemm


def sharding_label(config: FSDPConfig) -> str:
    """The `SHARDINGS` name of what `config` does: "no_shard", "full_shard" or "shard_grad_op"."""
    if config.replicate_only:
        return "no_shard"
    return "full_shard" if config.reshard_after_forward else "shard_grad_op"


def _pipeline_candidates(model: Any, config: FSDPConfig, request: Request, chunk: int | str | None
                         ) -> dict[tuple[str, str, int, int], Candidate]:
    """The pipeline's candidates (one per activation checkpointing mode), per step as the others' traces are: the
    planner traces the pipeline rank that peaks, with the rows of the microbatches it holds in flight; here its
    compute is counted for every microbatch and its ops and round trips once per microbatch, and the activations
    it sends (forward) and receives back (backward) are added. None when the model cannot be split (no pipeline
    plan, fewer layers than stages)."""
    from shardtrain.errors import ParallelDimsError, PipelineError
    from shardtrain.plan.memory import device_peak
    from shardtrain.plan.planner import plan

    steps = PIPELINE * request.gradient_accumulation_steps  # micro-batches per step: the same global batch
    try:
        result = plan(model, fsdp_config=config, world_size=request.world_size, **request.sizes, pp=PIPELINE,
                      pp_schedule=request.pp_schedule, pp_microbatches=request.pp_microbatches,
                      per_device_batch=request.per_device_batch, seq_len=request.seq_len,
                      gradient_accumulation_steps=steps, target=request.target, loss_chunk_size=chunk,
                      estimate_step_time=False, what_if=request.choose_ac)
    except (PlanError, PipelineError, ParallelDimsError):
        return {}
    pipeline = result.settings["pipeline"]
    count, held = pipeline["microbatches"], pipeline["microbatches_in_flight"]
    value_bytes = 2 if request.mixed_precision in ("bf16", "fp16") else 4
    # every micro-batch's activations go to the next stage and their gradient comes back
    p2p = 2 * request.per_device_batch * request.seq_len * _hidden_size(model) * value_bytes * steps
    label = sharding_label(config)
    found = {}
    for mode, trace in result.ac_traces.items():
        chunk_tokens = trace.loss_chunk_size if 0 < trace.loss_chunk_size < request.tokens else 0
        found[(label, mode, chunk_tokens, PIPELINE)] = Candidate(
            sharding=label, ac=mode, loss_chunk=chunk_tokens,
            peak=device_peak(trace, config.cpu_offload, request.target), flops=trace.flops * count / held,
            wire_bytes=trace.wire_bytes, ops=trace.ops * count,
            collective_calls=trace.collective_calls + 2 * count * steps, selective_ops=trace.selective_ops * count,
            wire_by_kind=dict(trace.wire_by_kind), units=len(trace.units), pp=PIPELINE, bubble=pipeline["bubble"],
            p2p_bytes=p2p)
    return found


def _hidden_size(model: Any) -> int:
    """The hidden size of `model` (a module or a directory), what one token's activations hold between stages."""
    config = getattr(model, "config", None)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    return int(config.hidden_size)


def _chunking_helps(model: Any, request: Request) -> bool:
    """Whether the loss chunk "auto" would split this model's micro-batch (checked on the module before tracing;
    a model given by its path is traced both ways)."""
    if not isinstance(model, torch.nn.Module):
        return True
    from shardtrain.train.step.chunked_loss import resolve_chunk_size

    chunk = resolve_chunk_size("auto", model, tensor_parallel=request.sizes.get("tp", 1) > 1)
    return 0 < chunk < request.tokens
