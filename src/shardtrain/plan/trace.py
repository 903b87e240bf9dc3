"""One Trainer step, traced on rank 0 of a fake process group with fake tensors: what each rank holds, when.

The model is built, context-parallelised and sharded by shardtrain's own code (`apply_layout`,
`build_optimizer`, `LossComputer`) and stepped by the Trainer's own `OptimizerStep`, but every tensor is a `FakeTensor`
and every collective goes to PyTorch's fake process group. Step 1 runs untraced (it creates AdamW's state); step 2
runs under PyTorch's `FSDPMemTracker` (one wrapper fixed, see `_tracker`), which labels every live storage
(sharded/unsharded parameters, gradients, optimizer state, activations, all-gather and reduce-scatter buffers) and
keeps the peak; for gloo, its reduce-scatter's input clone is added (`GlooCopies`). Step 1 also runs under
`FlopCounterMode` and a collective counter (for the step time); see `trace_modes`. LoRA adapters are added to the
meta-device model before it becomes fake (`with_adapters`).

    from shardtrain.plan.trace import trace_step
    trace = trace_step(builder, setup)      # a StepTrace; see shardtrain.plan.plan for the public entry
"""

from __future__ import annotations

import contextlib
import re
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import PlanError
from shardtrain.parallel.context import ContextParallel
from shardtrain.parallel.dims import Meshes, ParallelDims
from shardtrain.parallel.pipeline_settings import PipelineSettings
from shardtrain.parallel.pipeline_split import stage_split
from shardtrain.plan.experts import GroupedMmShapes
from shardtrain.plan.lifecycle import TensorLayout, tensor_layout
from shardtrain.plan.model_source import to_fake
from shardtrain.plan.trace_modes import (
    CollectiveCounter,
    GlooCopies,
    counting_selective_ops,
    flop_counter,
    real_device_meshes,
    step_tracker,
)

if TYPE_CHECKING:
    from shardtrain.train.step.micro import MicroStep

# FSDPMemTracker's categories (its _FSDPRefType values), grouped into the rows of the report
STATE_PARAM, STATE_GRAD, STATE_OPT = ("Sharded Param", "Buffer"), ("Sharded Grad",), ("OptState",)
GATHERED = ("Unsharded Param", "All Gather")
GRAD_BUFFERS = ("Unsharded Grad", "Reduce Scatter")
ACTIVATION = ("Activation", "Temp", "Inputs")
OFFLOADED = STATE_PARAM[:1] + STATE_GRAD + STATE_OPT  # on the host under cpu_offload
# The oldest torch the traced step is checked on. Seen on older ones (session 25): torch 2.11's memory tracker put
# the 1.2B Llama's peak at 36.8 GiB (an H100 measured 20.55 GiB, torch 2.13's trace says 20.5) and 9 of
# tests/plan failed; torch 2.9 has no fake implementation of the c10d collectives and cannot trace at all.
MIN_TORCH = (2, 13)


def require_torch_for_tracing(version: str | None = None) -> None:
    """Raise PlanError on a torch older than `MIN_TORCH`, where the traced step's figures are wrong or missing."""
    found = version or torch.__version__
    if tuple(int(part) for part in re.findall(r"\d+", found)[:2]) < MIN_TORCH:  # 2.13 nightlies ("2.13.0a0") pass
        wanted = ".".join(map(str, MIN_TORCH))
        raise PlanError(f"the planner traces the step on torch >= {wanted}; this is torch {found}, whose traced "
                        f"memory is wrong or missing (seen on 2.11 and 2.9); plan in an environment with "
                        f"torch >= {wanted}, or set the layout by hand")


@dataclass(frozen=True)
class StepSetup:
    """What one traced step runs: sizes, the parsed fsdp_config, batch shape and options."""

    dims: ParallelDims
    fsdp_config: FSDPConfig
    per_device_batch: int
    seq_len: int
    mixed_precision: str = "no"
    optimizer: str = "adamw_torch_fused"
    lora_rank: int = 0
    max_grad_norm: float = 1.0
    backend: str = "nccl"
    gradient_accumulation_steps: int = 1
    loss_chunk_size: int | str | None = None  # as TrainingArguments.loss_chunk_size
    pipeline: PipelineSettings | None = None  # pp > 1: the schedule (`plan.pipeline_estimate` says what is traced)
    rank: int = 0  # the fake rank traced (under pp: the first rank of the stage traced)


@dataclass
class StepTrace:
    """What rank 0 holds during a traced step (bytes) and what the step computes and communicates."""

    peak: int
    peak_breakdown: dict[str, int]
    peak_offloaded_device: int
    state: dict[str, int]
    units: list[tuple[str, int]]
    layer_activations: list[tuple[str, int]]
    logits: int
    loss_buffers: int
    flops: int
    loss_peak: int = 0  # the head + loss part: most bytes above those at the head's input, forward and backward
    loss_chunk_size: int = 0  # tokens per chunk the loss ran with (0: unchunked)
    collective_bytes: dict[str, int] = field(default_factory=dict)
    fsdp_shard_size: int = 1
    wire_bytes: int = 0  # what this rank sends per step with ring collectives, each over its own group
    wire_by_kind: dict[str, int] = field(default_factory=dict)  # the same per collective kind (trace_modes)
    gemm: tuple[int, int, int] | None = None  # (m, k, n) of the matmul shape that carries the most FLOPs
    ops: int = 0  # aten ops per step (host time per op)
    collective_calls: int = 0  # collectives over > 1 rank per step (a round trip each)
    selective_ops: int = 0  # ops selective checkpointing's policy decides on per step (its Python mode)
    tensors: list[TensorLayout] = field(default_factory=list)  # what save_model writes, as sharded (lifecycle.py)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _snapshot(tracker: Any) -> dict[str, int]:
    snap = tracker.get_tracker_snapshot("current")
    device = next(iter(snap.values()), {})
    return {str(getattr(k, "value", k)): v for k, v in device.items()}


def _sum(snap: dict[str, int], keys: tuple[str, ...]) -> int:
    return sum(snap.get(k, 0) for k in keys)


def _batch(setup: StepSetup, vocab: int, cp: Any, hidden: int | None = None) -> dict[str, Any]:
    """The traced micro-batch; `hidden`: a pipeline stage after the first, given the activations it receives."""
    ids = torch.randint(0, max(vocab, 2), (setup.per_device_batch, setup.seq_len))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if hidden is not None:
        batch["inputs_embeds"] = torch.zeros(setup.per_device_batch, setup.seq_len, hidden, requires_grad=True)
        del batch["input_ids"]
    if cp is not None:
        batch = cp.shard(batch, shift_labels=True, pad_token_id=0)
    return batch


def with_adapters(model: nn.Module, lora_rank: int) -> nn.Module:
    """LoRA adapters of rank `lora_rank` on every linear layer but the output head (peft's "all-linear"), added to
    the meta-device model as the Trainer adds them (`add_adapters`); 0: the model as it is."""
    if not lora_rank:
        return model
    from peft import LoraConfig

    from shardtrain.train.model.lora import add_adapters

    return add_adapters(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear",
                                          task_type="CAUSAL_LM"))


def _prepare(model: nn.Module, setup: StepSetup, meshes: Meshes) -> tuple[nn.Module, ContextParallel | None]:
    """(LoRA is added before: `with_adapters`) the Trainer's own `apply_layout`: context parallel, then tensor
    parallel -> expert parallel (its token exchange under uniform routing) -> FSDP."""
    from shardtrain.parallel.layout import Layout, apply_layout
    from shardtrain.plan.experts import register_uniform_all_to_all

    layout = Layout(meshes=meshes, dims=setup.dims, fsdp=setup.fsdp_config,
                    mixed_precision=setup.mixed_precision if setup.mixed_precision != "no" else None,
                    ep_implementation=register_uniform_all_to_all() if setup.dims.ep > 1 else "all_to_all",
                    cp=ContextParallel(meshes.cp) if setup.dims.cp > 1 else None,
                    pipeline=setup.pipeline or PipelineSettings())
    return apply_layout(model, layout), layout.cp


def _units(model: nn.Module, param_dtype: torch.dtype | None) -> list[tuple[str, int]]:
    """Each FSDP unit's own parameters, all-gathered (full size, in the dtype they are gathered in)."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    names = {id(m): n for n, m in model.named_modules()}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or id(group) in seen:  # one unit over several modules (final norm + lm_head)
            continue
        seen.add(id(group))
        if len(group.modules) > 1:
            names[id(module)] = "+".join(names[id(m)] for m in group.modules)
        size = sum(p._orig_size.numel() * (param_dtype or p.sharded_param.dtype).itemsize
                   for p in group.fsdp_params)
        out.append((names[id(module)] or "(root)", size))
    return out


class _Probe:
    """Forward hooks that read the tracker's live activations around each unit, the logits and the loss; and the
    peak of the loss part (`loss_peak`: from the head's input through the loss and back to its gradient)."""

    def __init__(self, model: nn.Module, tracker: Any, chunked: bool = False) -> None:
        from torch.distributed.fsdp import FSDPModule

        from shardtrain.train.step.chunked_loss import output_head

        self.tracker, self.layers, self.logits, self.after_forward, self.loss_buffers = tracker, [], 0, 0, 0
        self._logits_ref: weakref.ref | None = None
        self.handles, self.active, self.chunked = [], True, chunked
        names = {id(m): n for n, m in model.named_modules()}
        for module in model.modules():
            if isinstance(module, FSDPModule) and module is not model:
                self.handles.append(module.register_forward_pre_hook(self._pre))
                self.handles.append(module.register_forward_hook(self._make_post(names[id(module)])))
        self.handles.append(model.register_forward_hook(self._root_post))
        head = output_head(model)
        if head is not None:
            self.handles.append(head.register_forward_pre_hook(self._head_input))
        self._before, self.loss_peak, self._region = 0, 0, None

    def _total(self) -> int:
        return _snapshot(self.tracker).get("Total", 0)

    def _head_input(self, module: nn.Module, args: Any) -> None:
        """The loss part starts: the tracker's peak restarts from now (the step's own peak is put back at the end)."""
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if not self.active or hidden is None or not hidden.requires_grad or self._region is not None:
            return
        tracker = self.tracker
        self._region = (self._total(), dict(tracker._peak_mem), dict(tracker._peak_mem_snap))
        current = tracker.get_tracker_snapshot("current")
        tracker._peak_mem = {dev: snap.get("Total", 0) for dev, snap in current.items()}
        tracker._peak_mem_snap = current
        hidden.register_hook(self._head_input_grad)

    def _head_input_grad(self, grad: torch.Tensor) -> None:
        """The gradient reached the head's input: the loss part is over; keep the larger of both peaks."""
        base, peak, peak_snap = self._region
        tracker = self.tracker
        self.loss_peak = max(max(tracker._peak_mem.values(), default=0) - base, 0)
        for dev, value in peak.items():
            if value >= tracker._peak_mem.get(dev, 0):
                tracker._peak_mem[dev], tracker._peak_mem_snap[dev] = value, peak_snap[dev]

    def _act(self) -> int:
        return _sum(_snapshot(self.tracker), ("Activation", "Temp"))

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.active:
            self._before = self._act()

    def _make_post(self, name: str) -> Callable:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self.active:
                self.layers.append((name, self._act() - self._before))
        return post

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.active:
            logits = getattr(output, "logits", output if isinstance(output, torch.Tensor) else None)
            if self.chunked:  # the "logits" are the head's input: the full logits never exist
                logits = None
            self.logits = _local_bytes(logits) if isinstance(logits, torch.Tensor) else 0
            self._logits_ref = weakref.ref(logits) if isinstance(logits, torch.Tensor) else None
            self.after_forward = self._act()

    def at_loss(self) -> None:
        """After the loss, before backward: what the loss keeps for backward (its fp32 log-probabilities). The
        net change of live activations, plus the logits when the loss let them go (it keeps its own copy)."""
        freed = self.logits if self._logits_ref is not None and self._logits_ref() is None else 0
        self.loss_buffers = max(self._act() - self.after_forward + freed, 0)
        self.active = False  # activation checkpointing re-runs forwards in backward: not new activations

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def trace_step(build: Callable[[], nn.Module], setup: StepSetup) -> StepTrace:
    """Run two Trainer steps of `build()`'s model as rank 0 of `setup.dims.world_size` fake ranks.

    Raises:
        PlanError: a process group already exists in this process (the planner needs its own fake one).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardtrain.train.step.chunked_loss import resolve_chunk_size
    from shardtrain.train.step.loss import LossComputer
    from shardtrain.train.step.optim import build_optimizer, decay_parameter_names
    from shardtrain.train.step.optimizer_step import OptimizerStep

    require_torch_for_tracing()
    if dist.is_initialized():
        raise PlanError("shardtrain.plan() runs its own fake process group; call it before init_distributed() (or "
                        "run `shardtrain plan` as its own command)")
    # init_process_group wraps sys.excepthook to prefix "[rank0]: " and destroy does not unwrap it: without the
    # restore below every traced layout ("auto" traces ~10) added one more prefix to the run's error line
    excepthook = sys.excepthook
    dist.init_process_group("fake", rank=setup.rank, world_size=setup.dims.world_size, store=FakeStore())
    try:
        meshes = setup.dims.build("cpu")
        meta_model = with_adapters(build(), setup.lora_rank)
        with FakeTensorMode() as mode, GroupedMmShapes(), real_device_meshes():
            model, cp = _prepare(to_fake(meta_model, mode), setup, meshes)
            # the Trainer's optimizer: Hugging Face's groups, AdamW as `optim` names it (fused or foreach)
            optimizer = build_optimizer(model, decay_names=decay_parameter_names(model), weight_decay=0.0,
                                        cls=torch.optim.AdamW,
                                        kwargs={"lr": 1e-4, "fused": setup.optimizer == "adamw_torch_fused" or None})
            chunk = resolve_chunk_size(setup.loss_chunk_size, model, tensor_parallel=setup.dims.tp > 1)
            loss = LossComputer(model, torch.device("cpu"), chunk_size=chunk)
            vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
            split = stage_split(model)  # a pipeline stage after the first takes activations (its loss: a stand-in)
            hidden = model.config.hidden_size if split is not None and not split.is_first else None
            batch = _batch(setup, vocab, cp, hidden)
            samples = setup.per_device_batch * setup.dims.batch_size * setup.gradient_accumulation_steps
            # Gradient accumulation as the Trainer does it: no reduce-scatter before the last micro-batch, so the
            # unsharded gradients stay; memory repeats after the second micro-batch, which is all we trace.
            micro = min(setup.gradient_accumulation_steps, 2)
            engine_step = OptimizerStep(model=model, dims=setup.dims, device=torch.device("cpu"),
                                        all_reduce=dist.all_reduce, max_grad_norm=setup.max_grad_norm, sharded=True,
                                        loss=loss)

            def step(after_loss: Callable[[], None] | None = None,
                     between: Callable[[], None] | None = None) -> None:
                tokens = samples * setup.seq_len  # a scale only: fake tensors hold no labels to count
                engine_step.run([batch] * micro, None, PlannerStepHooks(loss, optimizer, after_loss, between), step=0,
                                by_samples=False, counts=(tokens, tokens))

            counter = CollectiveCounter()
            with flop_counter() as flops, counter, counting_selective_ops() as selective:
                step()
            tracker = step_tracker(model, optimizer)
            tracker.track_inputs((batch,))
            probe = _Probe(model, tracker, chunked=chunk > 0)
            with tracker, GlooCopies() if setup.backend == "gloo" else contextlib.nullcontext():
                # FSDPMemTracker keeps one forward per module per iteration: start its module stats afresh for
                # the second micro-batch (the overall peak it keeps is not reset)
                step(probe.at_loss, tracker.reset_mod_stats)
            probe.remove()
            return _result(model, optimizer, setup, tracker, probe, flops, counter, chunk, selective[0])
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


class PlannerStepHooks:
    """The planner's side of the Trainer's `OptimizerStep`: the loss and its backward, `after_loss` once (the
    probe that measures the loss's memory), `between` after each micro-batch but the last, the optimizer."""

    def __init__(self, loss: Any, optimizer: torch.optim.Optimizer, after_loss: Callable[[], None] | None,
                 between: Callable[[], None] | None) -> None:
        self.loss, self.optimizer, self.after_loss, self.between = loss, optimizer, after_loss, between

    def micro_step(self, micro: MicroStep) -> torch.Tensor:
        loss_sum = self.loss(micro.batch)
        if self.after_loss is not None:
            self.after_loss()
            self.after_loss = None
        (loss_sum * micro.grad_scale).backward()
        return loss_sum.detach()

    def between_micro_steps(self) -> None:
        if self.between is not None:
            self.between()

    def optimizer_step(self) -> float:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return 0.0

    def discard_step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        return 0.0


def _device_peak_offloaded(tracker: Any) -> int:
    """The peak without the tensors that CPU offload keeps on the host, over every snapshot the tracker kept."""
    best = 0
    for stats in tracker.memory_tracking.values():
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for dev_snap in snap.values():
                    named = {str(getattr(k, "value", k)): v for k, v in dev_snap.items()}
                    best = max(best, named.get("Total", 0) - _sum(named, OFFLOADED))
    return best


def _result(model: nn.Module, optimizer: torch.optim.Optimizer, setup: StepSetup, tracker: Any, probe: _Probe,
            flops: FlopCounterMode, counter: CollectiveCounter, loss_chunk_size: int, selective_ops: int = 0
            ) -> StepTrace:
    peak_snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    breakdown = {str(getattr(k, "value", k)): v for k, v in peak_snap.items()}
    params = sum(_local_bytes(p) for p in model.parameters()) + sum(_local_bytes(b) for b in model.buffers())
    grads = sum(_local_bytes(p) for p in model.parameters() if p.requires_grad)
    opt = sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.mixed_precision)
    fsdp_mesh = setup.dims.dp_shard * setup.dims.cp
    # step 1 ran min(accumulation, 2) micro-batches; a step runs all of them: their FLOPs and all-gathers repeat
    # (the reduce-scatter runs once, after the last; AdamW's FLOPs are negligible)
    scale = setup.gradient_accumulation_steps / min(setup.gradient_accumulation_steps, 2)
    collectives = {k: int(v * scale) if "allgather" in k else v for k, v in counter.bytes.items()}
    traced = sum(counter.bytes.values())  # the all-gathers repeat per micro-batch; scale the wire bytes alike
    scale_wire = sum(collectives.values()) / traced if traced else 1.0
    return StepTrace(
        peak=breakdown.get("Total", 0), peak_breakdown=breakdown,
        peak_offloaded_device=_device_peak_offloaded(tracker),
        state={"parameters": params, "gradients": grads, "optimizer_state": opt},
        units=_units(model, dtype), layer_activations=probe.layers, logits=probe.logits,
        loss_buffers=probe.loss_buffers, loss_peak=probe.loss_peak, loss_chunk_size=loss_chunk_size,
        flops=int(flops.get_total_flops() * scale),
        collective_bytes=collectives, fsdp_shard_size=fsdp_mesh, wire_bytes=int(counter.wire * scale_wire),
        wire_by_kind={k: int(v * scale_wire) for k, v in counter.wire_by_kind.items()},
        gemm=max(counter.gemm_flops, key=counter.gemm_flops.get) if counter.gemm_flops else None,
        ops=int(counter.ops * scale), collective_calls=int(counter.calls * scale),
        selective_ops=int(selective_ops * scale),
        tensors=tensor_layout(model))
