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


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout: its sharding, activation checkpointing and loss chunk (tokens; 0: off), and what it costs."""

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

    @property
    def name(self) -> str:
        """E.g. "full_shard, AC selective, loss chunk off" (the table's and the benchmark's key)."""
        return f"{self.sharding}, AC {self.ac}, loss chunk {self.loss_chunk or 'off'}"

    def step_s(self, rates: Rates) -> float:
        """Predicted seconds per step: compute, bytes on the wire, a round trip per collective, host time per op
        (more under selective checkpointing's Python policy). Only the gradient reductions count as overlapped,
        all but the last unit's share (1/n of n units' is exposed): on GPUs FSDP2 runs them in its own stream while
        the backward goes on. On gloo torch 2.13's FSDP2 waits for each reduction, so there the 1/n is a fit to
        measurements, not an overlap: per-layer units measured faster than one unit (the 50M Llama here: no_shard
        per layer 716 ms a step, as one unit 924 ms), which the plain sum predicted the other way round."""
        wire = self.wire_by_kind or {"other": self.wire_bytes}
        exposed = {kind: 1 / max(self.units, 1) for kind in BACKWARD_REDUCTIONS}
        return (self.flops / rates.flops_per_s
                + sum(sent * exposed.get(kind, 1.0) / rates.link_rate(kind) for kind, sent in wire.items())
                + self.collective_calls * rates.s_per_collective + self.ops * rates.s_per_op
                + self.selective_ops * rates.s_per_selective_op)

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

    @property
    def compute_dtype(self) -> torch.dtype:
        """The matmuls' dtype under the run's mixed precision (what the compute rate is timed in, as `plan`)."""
        from shardtrain.plan.step_time import COMPUTE_DTYPES

        return COMPUTE_DTYPES.get(self.mixed_precision, torch.float32)

    @property
    def tokens(self) -> int:
        """Tokens one rank's micro-batch holds (context parallelism splits each sequence)."""
        return self.per_device_batch * self.seq_len // self.sizes.get("cp", 1)


def request_for(spec: Any, args: Any, train_dataset: Any, device_type: str) -> Request:
    """The planning request of a Trainer run: which keys the user left free, and the step's shape.

    Raises:
        FSDPConfigError: the sequence length cannot be read from `train_dataset`.
    """
    config: FSDPConfig = spec.fsdp
    given = config.given
    sizes = {k: v for k, v in spec.sizes.items() if v}
    # no_shard and the sharding choice are for plain data parallelism: other sizes keep the sharding as given
    plain_dp = not any(sizes.get(k, 1) > 1 for k in ("cp", "tp", "ep", "dp_shard", "dp_replicate")) \
        and not config.hybrid
    return Request(world_size=spec.world_size, sizes=sizes, per_device_batch=args.per_device_train_batch_size,
                   seq_len=_seq_len(train_dataset), gradient_accumulation_steps=args.gradient_accumulation_steps,
                   mixed_precision=spec.mixed_precision, target="cpu" if device_type == "cpu" else "cuda",
                   choose_sharding=not ({"sharding_strategy", "reshard_after_forward"} & given) and plain_dp,
                   choose_ac="activation_checkpointing" not in given and not args.gradient_checkpointing,
                   choose_loss_chunk=args.loss_chunk_size is None, loss_chunk_setting=args.loss_chunk_size,
                   choose_units=device_type == "cpu" and "auto_wrap_policy" not in given)


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
        label = sharding or ("no_shard" if base.replicate_only else
                             "full_shard" if base.reshard_after_forward else "shard_grad_op")
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
    return list(found.values()), gemm


def _chunking_helps(model: Any, request: Request) -> bool:
    """Whether the loss chunk "auto" would split this model's micro-batch (checked on the module before tracing;
    a model given by its path is traced both ways)."""
    if not isinstance(model, torch.nn.Module):
        return True
    from shardtrain.train.step.chunked_loss import resolve_chunk_size

    chunk = resolve_chunk_size("auto", model, tensor_parallel=request.sizes.get("tp", 1) > 1)
    return 0 < chunk < request.tokens
