"""Pipeline parallelism for Hugging Face models on `torch.distributed.pipelining`: the model split into stages by
its own pipeline plan, each stage laid out as usual (TP, activation checkpointing, compile, FSDP), and one
schedule (GPipe, 1F1B, ...) running each micro-batch's forward and backward over the stages.

    split = split_model(model, stage=pp_rank, stages=pp)     # in place: other stages' modules become Skipped
    apply_layout(model, layout)                              # TP -> AC -> compile -> FSDP on what is left
    pipeline = Pipeline.build(model, split, layout, ...)     # the stage's FSDP root, PipelineStage, schedule
    loss_sum = pipeline.train(batch, targets, grad_scale)    # forward + backward of every pipeline microbatch

The split keeps the model object and its names: a module of another stage is replaced by `Skipped` (no
parameters, passes its first input through), so the kept layers stay under their original indices and a stage's
state-dict keys are the full model's keys (a checkpoint resumes on any pipeline size). A non-first stage runs the
model's own forward with `inputs_embeds` = the activations it receives; `Skipped` norm and head on a non-last
stage make its "logits" the hidden states it sends on. The rotary embedding, the masks and the position ids are
computed on every stage by the model's forward, from the `attention_mask` every stage is given.

Tied input and output embeddings stay tied: the first stage holds the embedding, the last the head, both the same
values; their gradients are summed over the pair before the step (Megatron's way), and the norm counts them once.

The loss is the token sum of every microbatch times the step's scale (1 / the global target tokens x FSDP's
average), so any microbatch count gives the step of one process; the schedule scales nothing (`scale_grads`
False). Every rank of the world pads its micro-batch to the same shape (rows to a multiple of the microbatches,
with rows that hold no target; columns to the longest, masked): the stages infer the activations' shapes again
only when that shape changes, all ranks together (the inference runs a forward, with FSDP's collectives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from shardtrain.errors import PipelineError
from shardtrain.model_facts import IGNORE_INDEX, TIED_ACROSS_STAGES
from shardtrain.parallel import collectives

# the schedules of torch.distributed.pipelining, by the names `pp_schedule` takes; those of several stages per rank
# are refused for now (`check_settings`)
SCHEDULES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
             "LoopedBFS": "ScheduleLoopedBFS", "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
             "ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
SINGLE_STAGE = ("GPipe", "1F1B")
# the inputs every stage is given (the others go to the first stage only, or are refused)
STAGE_KWARGS = ("attention_mask", "position_ids")


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """`pp_schedule` and `pp_microbatches` (None: as many microbatches as stages)."""

    schedule: str = "1F1B"
    microbatches: int | None = None

    def microbatches_for(self, stages: int) -> int:
        return stages if self.microbatches is None else self.microbatches


def check_settings(settings: PipelineSettings, *, stages: int, per_device_batch: int | None = None) -> None:
    """Refuse a schedule or microbatch count the pipeline cannot run, with the numbers.

    Raises:
        PipelineError: an unknown or multi-stage schedule, microbatches < 1, fewer microbatches than stages
            under 1F1B, or a micro-batch of fewer rows than microbatches (or not a multiple of them).
    """
    from shardtrain.config.values import closest

    if settings.schedule not in SCHEDULES:
        raise PipelineError(f"pp_schedule = {settings.schedule!r} is not a schedule; use one of {list(SCHEDULES)}"
                            f"{closest(settings.schedule, list(SCHEDULES))}")
    if settings.schedule not in SINGLE_STAGE:
        raise PipelineError(f"pp_schedule = {settings.schedule!r} runs several stages per rank, which shardtrain "
                            f"does not split models into yet; use one of {list(SINGLE_STAGE)}")
    count = settings.microbatches_for(stages)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PipelineError(f"pp_microbatches = {settings.microbatches!r} must be an int >= 1")
    if settings.schedule == "1F1B" and count < stages:
        raise PipelineError(f"pp_microbatches = {count} is fewer than the {stages} pipeline stages, which 1F1B "
                            f"needs at least; set pp_microbatches >= {stages}, or pp_schedule 'GPipe'")
    if per_device_batch is not None and per_device_batch % count:
        raise PipelineError(
            f"per_device_train_batch_size = {per_device_batch} does not split into pp_microbatches = {count} equal "
            f"microbatches; make the batch a multiple of {count} (e.g. {count * max(1, per_device_batch // count)}) "
            "or choose pp_microbatches among its divisors")


class Skipped(nn.Module):
    """A module of another pipeline stage: no parameters; passes its first input through (a layer's hidden
    states, the norm's input, the head's input)."""

    pipeline_skipped = True  # (read by the layout's stages: nothing to shard or wrap here)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """What one rank's stage holds.

    Attributes:
        stage, stages: this stage's index and the pipeline's stage count.
        layers: the range of decoder layers it keeps (original indices).
        tied: the model's input and output embeddings are tied and live on different stages (first: the
            embedding, last: the head), their gradients summed over the pair.
        tied_names: (the embedding's weight name, the head's) when `tied`: a checkpoint holds the pair under the
            embedding's name, as an unsplit model's optimizer does (the last stage publishes its head under it).
    """

    stage: int
    stages: int
    layers: range
    tied: bool
    tied_names: tuple[str, str] | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


def layer_ranges(num_layers: int, stages: int) -> list[range]:
    """An even split of `num_layers` over `stages` (the first stages take one more where it does not divide)."""
    each, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        end = start + each + (stage < extra)
        ranges.append(range(start, end))
        start = end
    return ranges


def _pipeline_plan(model: nn.Module) -> tuple[nn.Module, list[str], str, list[str]]:
    """(base model, its modules before the layers, the layers' name, its modules after them) from the model's
    `config.base_model_pp_plan`, and the top-level modules of its `_pp_plan` (the head) after those.

    Raises:
        PipelineError: the model has no plan, or a plan without one list of layers.
    """
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not plan or not isinstance(base, nn.Module):
        raise PipelineError(
            f"{type(model).__name__} has no pipeline plan (config.base_model_pp_plan), so it cannot be split into "
            "stages; use a transformers model that declares one (Llama, Qwen2, Qwen3, Mistral, ...), or pp_size 1")
    names = list(plan)
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(lists) != 1:
        raise PipelineError(f"{type(model).__name__}'s pipeline plan {names} has {len(lists)} lists of layers; "
                            "shardtrain splits models with exactly one; use pp_size 1")
    at = names.index(lists[0])
    head = [n for n in (getattr(model, "_pp_plan", None) or {}) if isinstance(getattr(model, n, None), nn.Module)]
    return base, names[:at], lists[0], names[at + 1:] + head


STAGE_ATTR = "_shardtrain_pipeline_stage"  # the `StageSplit` a split model carries


def stage_split(model: nn.Module) -> StageSplit | None:
    """The stage a split model holds (`split_model`), or None."""
    return getattr(model, STAGE_ATTR, None)


def split_model(model: nn.Module, *, stage: int, stages: int) -> StageSplit:
    """Keep, in place, what stage `stage` of `stages` runs (see the module docstring); the other stages' modules
    become `Skipped`. The model carries the `StageSplit` (`stage_split`).

    Raises:
        PipelineError: a model without a pipeline plan, or fewer layers than stages.
    """
    outer = model  # a PEFT model is split through its base model; names (and the split's record) are the outer's
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    base, before, layers_name, after = _pipeline_plan(model)
    layers = getattr(base, layers_name)
    if len(layers) < stages:
        raise PipelineError(f"{type(model).__name__} has {len(layers)} layers, fewer than the pp_size = {stages} "
                            f"stages (each needs one at least); use pp_size <= {len(layers)}")
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    tied = stages > 1 and embedding is not None and head is not None and \
        getattr(embedding, "weight", None) is getattr(head, "weight", None)
    tied_names = None
    if tied:  # each stage keeps its copy whole (not tensor-parallel), as a tied pair is in one process
        setattr(embedding, TIED_ACROSS_STAGES, True)
        setattr(head, TIED_ACROSS_STAGES, True)
        names = {id(m): n for n, m in outer.named_modules()}
        tied_names = (f"{names[id(embedding)]}.weight", f"{names[id(head)]}.weight")
    kept = layer_ranges(len(layers), stages)[stage]
    for index in range(len(layers)):
        if index not in kept:
            layers[index] = Skipped()
    first, last = stage == 0, stage == stages - 1
    for name in before if not first else ():
        setattr(base, name, Skipped())
    for name in after if not last else ():
        owner = base if hasattr(base, name) and name not in getattr(model, "_pp_plan", {}) else model
        setattr(owner, name, Skipped())
    split = StageSplit(stage=stage, stages=stages, layers=kept, tied=tied, tied_names=tied_names)
    setattr(outer, STAGE_ATTR, split)
    return split


def published_aliases(model: nn.Module) -> dict[str, str]:
    """Checkpoint name -> this stage's parameter name, for the entries a stage publishes under another name: the
    last stage's half of tied embeddings goes under the embedding's name (as one process saves its optimizer
    state), so that checkpoints of any pipeline size hold the same keys."""
    split = stage_split(model)
    if split is None or split.tied_names is None or not split.is_last:
        return {}
    embedding, head = split.tied_names
    return {embedding: head}


class StageModule(nn.Module):
    """The module a `PipelineStage` runs: the stage's part of the model, called with `input_ids` (first stage) or
    the received activations as `inputs_embeds`; returns the logits (last stage) or the hidden states to send.
    It holds no parameters of its own; FSDP makes it the stage's root unit."""

    def __init__(self, model: nn.Module, *, first: bool) -> None:
        super().__init__()
        self.model, self.first = model, first

    def forward(self, inputs: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        key = "input_ids" if self.first else "inputs_embeds"
        outputs = self.model(**{key: inputs}, **kwargs, use_cache=False)
        return outputs.logits if hasattr(outputs, "logits") else outputs[0]


@dataclass(kw_only=True)
class _StepInputs:
    """The loss function's view of the micro-batch in flight."""

    grad_scale: float = 1.0
    label_smoothing: float = 0.0
    sums: list[torch.Tensor] = field(default_factory=list)


class Pipeline:
    """One rank's stage of the pipeline and its schedule (see the module docstring); built by `Pipeline.build`."""

    def __init__(self, *, split: StageSplit, root: nn.Module, stage: PipelineStage, schedule: Any,
                 pp_group: Any, tie_group: Any, microbatches: int, device: torch.device, pad_token: int) -> None:
        self.split, self.root, self.stage, self.schedule = split, root, stage, schedule
        self.pp_group, self.tie_group, self.microbatches = pp_group, tie_group, microbatches
        self.device, self.pad_token = device, pad_token
        self._shape: tuple[int, int] | None = None  # the shape the stages inferred their activations' for
        self._step: tuple[int, int] | None = None  # the shape of the optimizer step in progress (`step_shape`)
        self._inputs = _StepInputs()

    @classmethod
    def build(cls, model: nn.Module, split: StageSplit, *, pp_mesh: Any, settings: PipelineSettings,
              device: torch.device, shard_root: Callable[[nn.Module], None]) -> Pipeline:
        """The stage's `PipelineStage` and schedule over `model` (split and laid out already); `shard_root`
        makes the stage module the FSDP root (the schedule reduces the gradients once, after the last
        microbatch)."""
        root = StageModule(model, first=split.is_first)
        shard_root(root)
        group = pp_mesh.get_group()
        stage = PipelineStage(root, split.stage, split.stages, device, group=group)
        microbatches = settings.microbatches_for(split.stages)
        pipeline: Pipeline
        schedule_cls = getattr(torch_schedules, SCHEDULES[settings.schedule])
        schedule = schedule_cls(stage, n_microbatches=microbatches, loss_fn=lambda out, target: pipeline._loss(
            out, target), scale_grads=False)
        tie_group = _tie_group(split, pp_mesh) if split.tied else None
        config = getattr(model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        pipeline = cls(split=split, root=root, stage=stage, schedule=schedule, pp_group=group, tie_group=tie_group,
                       microbatches=microbatches, device=device, pad_token=pad if isinstance(pad, int) else 0)
        return pipeline

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        inputs = self._inputs
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=inputs.label_smoothing)
        inputs.sums.append(loss.detach())
        return loss * inputs.grad_scale

    def _agreed_shape(self, rows: int, columns: int) -> tuple[int, int]:
        """The (rows, columns) every rank pads to: the largest, rows up to a multiple of the microbatches."""
        shape = torch.tensor([rows, columns], dtype=torch.int64, device=self.device)
        collectives.all_reduce(shape, op=dist.ReduceOp.MAX)
        rows, columns = shape.tolist()
        return -(-rows // self.microbatches) * self.microbatches, columns

    @contextlib.contextmanager
    def step_shape(self, batches: list[dict[str, Any]]) -> Iterator[None]:
        """One shape for every micro-batch of an optimizer step (`batches`: this rank's), agreed by every rank: the
        stages' shape inference, when the shape changes, runs before the step's first microbatch only (it clears
        the gradients of the stage)."""
        shapes = [b["input_ids"].shape for b in batches if isinstance(b, dict) and "input_ids" in b]
        self._step = self._agreed_shape(max(s[0] for s in shapes), max(s[1] for s in shapes)) if shapes else None
        try:
            yield
        finally:
            self._step = None

    def _padded(self, batch: dict[str, torch.Tensor], targets: torch.Tensor) -> tuple[dict, torch.Tensor]:
        ids = batch["input_ids"]
        rows, columns = self._step or self._agreed_shape(*ids.shape)
        if self._shape is not None and self._shape != (rows, columns):
            # the stages infer the activations' shapes again (every rank at once: the shape is agreed)
            self.schedule._stage_forward_initialized = False
            self.schedule._stage_backward_initialized = False
        self._shape = (rows, columns)
        extra_rows, extra_columns = rows - ids.shape[0], columns - ids.shape[1]
        if not extra_rows and not extra_columns:
            return batch, targets
        mask = batch.get("attention_mask", torch.ones_like(ids))
        out = {"input_ids": _pad(ids, extra_rows, extra_columns, self.pad_token),
               # padded columns are masked; padded rows attend to themselves (no fully masked row) and hold no target
               "attention_mask": torch.cat([F.pad(mask, (0, extra_columns), value=0),
                                            torch.ones(extra_rows, columns, dtype=mask.dtype, device=mask.device)])}
        if "position_ids" in batch:
            positions = torch.arange(columns, device=ids.device).expand(rows, columns).clone()
            positions[:ids.shape[0], :ids.shape[1]] = batch["position_ids"]
            out["position_ids"] = positions
        return out, _pad(targets, extra_rows, extra_columns, IGNORE_INDEX)

    @staticmethod
    def _check_keys(batch: dict[str, Any]) -> None:
        unknown = sorted(k for k in batch if k not in ("input_ids", *STAGE_KWARGS))
        if unknown:
            raise PipelineError(f"a batch for a pipeline holds {unknown}, which the stages cannot pass on; the "
                                f"pipeline takes {['input_ids', *STAGE_KWARGS]} and labels")

    def train(self, batch: dict[str, torch.Tensor], targets: torch.Tensor, *, grad_scale: float,
              label_smoothing: float = 0.0) -> torch.Tensor:
        """Forward and backward of one micro-batch over the pipeline, each token loss's gradient times
        `grad_scale`; the micro-batch's loss sum on the last stage, 0 on the others (not synchronised)."""
        self._check_keys(batch)
        batch, targets = self._padded(batch, targets)
        self._inputs = _StepInputs(grad_scale=grad_scale, label_smoothing=label_smoothing)
        kwargs = {k: batch[k] for k in STAGE_KWARGS if k in batch}
        args = (batch["input_ids"],) if self.split.is_first else ()
        target = targets if self.split.is_last else None
        self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        # (the stages' shape inference calls the loss too, before the microbatches: those calls are not losses)
        sums = self._inputs.sums[-self.microbatches:] if self.split.is_last else []
        return torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)

    def evaluate(self, batch: dict[str, torch.Tensor],
                 targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward of one batch over the pipeline (the schedule's eval mode): (its loss sum, 0 without
        `targets`; the logits, cut back to the batch's shape), both on the last stage; (0, None) on the others."""
        self._check_keys(batch)
        rows, columns = batch["input_ids"].shape
        if targets is None:  # predictions only: a target that counts nothing
            targets = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        batch, targets = self._padded(batch, targets)
        self._inputs = _StepInputs()
        kwargs = {k: batch[k] for k in STAGE_KWARGS if k in batch}
        args = (batch["input_ids"],) if self.split.is_first else ()
        logits = self.schedule.eval(*args, target=targets if self.split.is_last else None, **kwargs)
        if not self.split.is_last:
            return torch.zeros((), device=self.device), None
        return torch.stack(self._inputs.sums[-self.microbatches:]).sum(), logits[:rows, :columns]

    def tied_parameter(self) -> nn.Parameter | None:
        """This stage's copy of tied embeddings (the first stage's embedding, the last's head), or None."""
        if not self.split.tied or not (self.split.is_first or self.split.is_last):
            return None
        model = self.root.model
        module = model.get_input_embeddings() if self.split.is_first else model.get_output_embeddings()
        return module.weight

    def sum_tied_grads(self) -> None:
        """Sum the tied embeddings' gradients over the first and the last stage (both then hold the gradient of the
        one tied weight of an unsplit model)."""
        weight = self.tied_parameter()
        if weight is None or weight.grad is None:
            return
        grad = weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        collectives.all_reduce(local, group=self.tie_group)

    def uncounted(self) -> set[int]:
        """Parameters the gradient norm leaves out: the last stage's copy of tied embeddings (counted on the
        first)."""
        weight = self.tied_parameter()
        return {id(weight)} if weight is not None and self.split.is_last else set()


def _tie_group(split: StageSplit, pp_mesh: Any) -> Any:
    """The process group of this rank's first and last stage (same place in their stages); collective."""
    if split.stages == 2:
        return pp_mesh.get_group()
    world, stages = dist.get_world_size(), split.stages
    per_stage = world // stages
    pairs = [[rank, rank + (stages - 1) * per_stage] for rank in range(per_stage)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _pad(tensor: torch.Tensor, rows: int, columns: int, value: int) -> torch.Tensor:
    tensor = F.pad(tensor, (0, columns), value=value)
    if rows:
        tensor = torch.cat([tensor, tensor.new_full((rows, tensor.shape[1]), value)])
    return tensor
