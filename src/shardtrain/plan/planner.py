"""`shardtrain.plan(...)`: per-rank memory and step time of a Trainer run, predicted from a traced step.

    import shardtrain
    result = shardtrain.plan("config.json", world_size=8, per_device_batch=4, seq_len=2048, bf16=True,
                             fsdp_config={"activation_checkpointing": True}, device_memory="80GiB")
    print(result.table())          # or result.to_dict() (what `shardtrain plan --json` prints)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.config.fsdp_config import AC_MODES, FSDPConfig, parse_activation_checkpointing
from shardtrain.errors import PlanError
from shardtrain.parallel.dims import ParallelDims
from shardtrain.plan.lifecycle import PhaseMemory, host_per_machine, lifecycle_rows
from shardtrain.plan.memory import device_peak, fit_advice, memory_rows, parse_bytes
from shardtrain.plan.model_source import model_builder
from shardtrain.plan.result import Plan
from shardtrain.plan.trace import StepSetup, StepTrace, trace_step

OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
_AC_VALUES: dict[str, bool | str] = {"none": False, "full": True, "selective": "selective"}  # fsdp_config values
TARGETS = ("cuda", "cpu")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} = {value!r} must be an int >= 1")
    return value


def _fsdp_config(fsdp_config: dict | str | os.PathLike | FSDPConfig | None, overrides: dict[str, Any]) -> FSDPConfig:
    """Parse like the Trainer (`FSDPConfig.load`), with the planner's flags applied on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if "activation_checkpointing" in given:  # "none" / "full" / "selective" as the stored False / True / "selective"
        given["activation_checkpointing"] = parse_activation_checkpointing(given["activation_checkpointing"])
    if isinstance(fsdp_config, FSDPConfig):
        return dataclasses.replace(fsdp_config, **given)
    if isinstance(fsdp_config, str | os.PathLike):
        FSDPConfig.load(fsdp_config)  # the file's (or text's) own errors first, with its path
        text = str(fsdp_config)
        fsdp_config = json.loads(text if text.lstrip().startswith("{") else Path(fsdp_config).read_text())
    if fsdp_config is not None and not isinstance(fsdp_config, dict):
        return FSDPConfig.load(fsdp_config)  # raises the Trainer's error for the wrong type
    return FSDPConfig.load({**(fsdp_config or {}), **given})


def _lifecycle(trace: StepTrace, config: FSDPConfig, world_size: int, target: str, device_peak_: int
               ) -> list[PhaseMemory]:
    """The load / step / save rows; under CPU offload on an accelerator the step's sharded state is host memory."""
    offloaded = trace.peak - trace.peak_offloaded_device if config.cpu_offload and target != "cpu" else 0
    state = trace.state["parameters"] + trace.state["optimizer_state"]  # gradients are freed after each step
    return lifecycle_rows(trace.tensors, world_size=world_size, target=target, cpu_offload=config.cpu_offload,
                          cpu_ram_efficient_loading=config.cpu_ram_efficient_loading,
                          state_dict_type=config.state_dict_type, step_device=device_peak_, step_host=offloaded,
                          training_state=state,
                          largest_local_state=max((t.local_bytes for t in trace.tensors), default=0))


def plan(model: str | os.PathLike | nn.Module | Any, *,
         fsdp_config: dict | str | os.PathLike | FSDPConfig | None = None,
         world_size: int | None = None, dp_replicate: int | None = None, dp_shard: int | None = None, cp: int = 1,
         tp: int = 1, ep: int = 1, pp: int = 1, pp_schedule: str = "1F1B", pp_microbatches: int | None = None,
         per_device_batch: int = 1, seq_len: int = 2048, gradient_accumulation_steps: int = 1,
         bf16: bool = False,
         activation_checkpointing: bool | str | None = None, cpu_offload: bool | None = None,
         reshard_after_forward: bool | None = None, optimizer: str = "adamw_torch_fused", lora_rank: int = 0,
         device_memory: str | int | None = None, target: str = "cuda", tflops: float | None = None,
         link_gbps: float | None = None, estimate_step_time: bool = True, what_if: bool = True,
         loss_chunk_size: int | str | None = None, rate_sources: tuple[str | None, str | None] = (None, None),
         mfu: float = 1.0, host_memory: str | int | None = None, ranks_per_machine: int | None = None) -> Plan:
    """Predict what each rank holds during a Trainer step, and how long the step takes.

    Args:
        model: a transformers `config.json`, a model directory, a `PretrainedConfig` or an `nn.Module`.
        fsdp_config: as `TrainingArguments.fsdp_config` (dict or JSON path); parsed by `FSDPConfig.load`.
        world_size: ranks; default: the product of the sizes given (1 when none is).
        dp_replicate: data-parallel replicas (HSDP's outer dimension); the sizes are resolved by
            `ParallelDims.resolve` like the Trainer's.
        dp_shard: ranks each parameter is sharded over.
        cp: context-parallel size.
        tp: tensor-parallel size.
        ep: expert-parallel size.
        pp: pipeline-parallel size (the outermost dimension); `pp_schedule` (any the Trainer takes) and
            `pp_microbatches` as the Trainer's. The pipeline rank traced is the first or the last, whichever peaks
            higher, holding its stages (two under a schedule of two per rank) and the activations of the
            microbatches it holds in flight (`plan.pipeline_estimate`); the step time is that rank's, over 1 - the
            schedule's bubble.
        per_device_batch: the samples one rank sees per micro-batch.
        seq_len: their full sequence length (cp splits it).
        gradient_accumulation_steps: micro-batches per step (> 1: unsharded gradients stay between them).
        bf16: mixed precision (bf16 parameters in compute, fp32 gradient reduction), as `TrainingArguments.bf16`.
        activation_checkpointing: overrides that fsdp_config key: True / "full", "selective" or False.
        cpu_offload: overrides that fsdp_config key.
        reshard_after_forward: overrides that fsdp_config key.
        optimizer: "adamw_torch_fused" (the Trainer's default) or "adamw_torch".
        lora_rank: > 0: LoRA adapters of that rank on every linear layer but the head (the base frozen).
        device_memory: e.g. "80GiB": say whether the peak fits, and what would make it fit.
        target: "cuda" (NCCL; CPU offload keeps sharded state on the host) or "cpu" (gloo, whose reduce-scatter
            clones its input; everything on one memory).
        tflops: the device's compute rate for the step time; measured on this machine when missing.
        link_gbps: the collectives' bandwidth; measured on this machine when missing.
        estimate_step_time: False: skip the rate calibration and the step time.
        what_if: also trace the other activation-checkpointing modes (per-layer rows and advice).
        loss_chunk_size: as `TrainingArguments.loss_chunk_size`: the LM head and cross entropy run that many
            tokens at a time ("auto": the Trainer's choice; a model where it is not exact falls back / raises alike).

    Raises:
        PlanError, FSDPConfigError, ParallelDimsError: an input that cannot be used (the message names it).
    """
    build, name = model_builder(model)
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer = {optimizer!r}: the planner models {list(OPTIMIZERS)}")
    if target not in TARGETS:
        raise PlanError(f"target = {target!r} must be one of {list(TARGETS)}")
    per_device_batch, seq_len = _positive("per_device_batch", per_device_batch), _positive("seq_len", seq_len)
    accumulation = _positive("gradient_accumulation_steps", gradient_accumulation_steps)
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise PlanError(f"lora_rank = {lora_rank!r} must be an int >= 0 (0: no LoRA)")
    if lora_rank:
        from shardtrain.train.model.lora import require_peft

        require_peft()  # a clear error when peft is missing
    for size_name, size in (("tp", tp), ("ep", ep)):
        if lora_rank and size > 1:  # as the Trainer (train/model/preparation.py)
            raise PlanError(f"lora_rank = {lora_rank} with {size_name} = {size}: the Trainer does not train LoRA "
                            f"adapters with {size_name}_size > 1 yet; plan the adapters with data (and context) "
                            f"parallelism, {size_name} = 1")
    config = _fsdp_config(fsdp_config, {"activation_checkpointing": activation_checkpointing,
                                        "cpu_offload": cpu_offload, "reshard_after_forward": reshard_after_forward})
    if world_size is None:
        world_size = (dp_replicate or 1) * (dp_shard or 1) * cp * tp * pp
    dims = ParallelDims.resolve(world_size=_positive("world_size", world_size), dp_replicate=dp_replicate,
                                dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, pp=pp, fsdp_config=config)
    if seq_len % (2 * dims.cp) and dims.cp > 1:
        raise PlanError(f"seq_len = {seq_len} with cp = {dims.cp}: context parallelism splits each sequence into "
                        f"2 x cp chunks; use a multiple of {2 * dims.cp}")
    precision = "bf16" if bf16 else (config.mixed_precision or "no")
    try:
        from shardtrain.errors import ChunkedLossError
        from shardtrain.train.step.chunked_loss import parse_setting

        loss_chunk_size = parse_setting(loss_chunk_size)
    except ChunkedLossError as err:
        raise PlanError(str(err).replace("TrainingArguments.", "")) from None
    setup = StepSetup(dims=dims, fsdp_config=config, per_device_batch=per_device_batch, seq_len=seq_len,
                      mixed_precision=precision, optimizer=optimizer, lora_rank=lora_rank,
                      backend="gloo" if target == "cpu" else "nccl", gradient_accumulation_steps=accumulation,
                      loss_chunk_size=loss_chunk_size)
    pipeline = None
    if dims.pp > 1:
        setup, trace, pipeline = _pipeline_stage(build, setup, pp_schedule, pp_microbatches)
    else:
        trace = trace_step(build, setup)
    ac_traces = {config.ac_mode: trace}
    if what_if and trace.units:
        # the same step under each other mode: selective AC's policy runs inside the traced checkpoint wrappers
        for mode in AC_MODES:
            if mode not in ac_traces:
                changed = dataclasses.replace(config, activation_checkpointing=_AC_VALUES[mode])
                ac_traces[mode] = trace_step(build, dataclasses.replace(setup, fsdp_config=changed))
    other = ac_traces.get("none" if config.ac_mode == "full" else "full")
    kept = ("reshard_after_forward", "cpu_offload", "activation_checkpointing", "auto_wrap_policy",
            "transformer_layer_cls_to_wrap", "output_unit", "cpu_ram_efficient_loading", "state_dict_type")
    settings = {"world_size": dims.world_size, "parallel": dims.describe(), "per_device_batch": per_device_batch,
                "seq_len": seq_len, "gradient_accumulation_steps": accumulation, "mixed_precision": precision,
                "optimizer": optimizer, "lora_rank": lora_rank, "target": target, "backend": setup.backend,
                "loss_chunk_size": trace.loss_chunk_size,
                "fsdp_config": {k: v for k, v in config.to_dict().items() if k in kept}}
    if pipeline is not None:
        settings["pipeline"] = pipeline
    peak = device_peak(trace, config.cpu_offload, target)
    result = Plan(model=name, settings=settings, trace=trace, rows=memory_rows(trace, ac_traces),
                  peak=peak, what_if_ac=other, ac_traces=ac_traces,
                  lifecycle=_lifecycle(trace, config, dims.world_size, target, peak))
    if device_memory is not None:
        fixed = dims.dp_replicate * dims.cp * dims.tp
        result.fit = fit_advice(trace, ac_traces, parse_bytes(device_memory), cpu_offload=config.cpu_offload,
                                ac_mode=config.ac_mode, target=target,
                                world_size=dims.world_size, fixed=fixed)
    if estimate_step_time:
        from shardtrain.plan.step_time import COMPUTE_DTYPES, Rates, step_time

        threads = None
        if target == "cpu":  # the threads one rank trains with: launchers give each of several ranks one
            threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or (1 if dims.world_size > 1 else None)
        device = "cuda" if target == "cuda" and torch.cuda.is_available() else "cpu"
        # a pipeline stage computes every microbatch of the micro-batch (the trace held those in flight at once)
        timed = trace if pipeline is None else dataclasses.replace(
            trace, flops=int(trace.flops * per_device_batch / setup.per_device_batch))
        result.step = step_time(timed, Rates.resolve(tflops, link_gbps, device, gemm=trace.gemm, threads=threads,
                                                  dtype=COMPUTE_DTYPES.get(precision, torch.float32),
                                                  tflops_source=rate_sources[0], link_source=rate_sources[1]),
                                mfu=mfu)
        if pipeline is not None:  # the stage idles for the schedule's bubble
            result.step["pipeline_bubble"] = pipeline["bubble"]
            for key in ("step_s_no_overlap", "step_s_full_overlap", "step_s_at_mfu_no_overlap",
                        "step_s_at_mfu_full_overlap"):
                result.step[key] /= 1 - pipeline["bubble"]
    if result.lifecycle:
        result.host = host_per_machine(result.lifecycle, dims.world_size, parse_bytes(host_memory)
                                       if host_memory is not None else None, ranks_per_machine)
    return result


def _pipeline_stage(build: Any, setup: StepSetup, schedule: str, microbatches: int | None
                    ) -> tuple[StepSetup, StepTrace, dict[str, Any]]:
    """The traced step of the pipeline stage that peaks higher, the first (the most microbatches in flight under
    1F1B, the embeddings) or the last (the head and the logits): each traced with the rows of the microbatches it
    holds at once (`pipeline_estimate.in_flight`). Returns (its setup, its trace, what the plan reports)."""
    from shardtrain.parallel.pipeline_settings import PipelineSettings, check_settings
    from shardtrain.plan.pipeline_estimate import bubble_fraction, in_flight

    dims = setup.dims
    settings = PipelineSettings(schedule=schedule, microbatches=microbatches)
    check_settings(settings, pp=dims.pp, per_device_batch=setup.per_device_batch)
    count = settings.microbatches_for(dims.pp)
    best = None
    for stage in (0, dims.pp - 1):
        held = in_flight(schedule, stages=dims.pp, microbatches=count, stage=stage)
        staged = dataclasses.replace(setup, pipeline=settings, rank=stage * dims.stage_size,
                                     per_device_batch=setup.per_device_batch // count * held)
        trace = trace_step(build, staged)
        if best is None or trace.peak > best[1].peak:
            best = staged, trace, {"schedule": schedule, "microbatches": count, "stage_traced": stage,
                                   "microbatches_in_flight": held,
                                   "bubble": bubble_fraction(schedule, stages=dims.pp, microbatches=count)}
    return best
