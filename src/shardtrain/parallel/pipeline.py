"""Pipeline parallelism for Hugging Face models on `torch.distributed.pipelining`: the model split into stages by
its own pipeline plan, each stage laid out as usual (TP, activation checkpointing, compile, FSDP), and one
schedule (GPipe, 1F1B, ...) running each micro-batch's forward and backward over the stages.

    split = split_for_rank(model, settings, pp_rank, pp)     # in place (`pipeline_split`): this rank's stages
    apply_layout(model, layout)                              # TP -> AC -> compile -> FSDP on what is left
    pipeline = Pipeline.build(model, split, ...)             # FSDP root, PipelineStage(s), the schedule
    loss_sum = pipeline.train(batch, targets, grad_scale)    # forward + backward of every pipeline microbatch

A stage runs the model's own forward (`pipeline_split` keeps the model object and its names): the first with
`input_ids`, the others with the activations they receive as `inputs_embeds`; a skipped norm and head make a
non-last stage's "logits" the hidden states it sends on. The rotary embedding, the masks and the position ids are
computed on every stage by the model's forward, from the `attention_mask` every stage is given. Schedules of
two stages per rank (Interleaved 1F1B, looped BFS: rank r holds stages r and r + pp) hold both.

Tied input and output embeddings stay tied: on two ranks the first stage holds the embedding, the last the head,
both the same values, their gradients summed over the pair before the step (Megatron's way) and counted once by
the norm.

The loss is the token sum of every microbatch times the step's scale (1 / the global target tokens x FSDP's
average), so any microbatch count gives the step of one process; the schedule scales nothing (`scale_grads`
False). Every rank of the world pads its micro-batch to the same shape (rows to a multiple of the microbatches,
with rows that hold no target; columns to the longest, masked): the stages infer the activations' shapes again
only when that shape changes, all ranks together (the inference runs a forward, with FSDP's collectives).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from shardtrain.errors import PipelineError
from shardtrain.model_facts import IGNORE_INDEX
from shardtrain.parallel import collectives
from shardtrain.parallel.pipeline_settings import SCHEDULES, SPLIT_BACKWARD, PipelineSettings
from shardtrain.parallel.pipeline_split import StageSplit, active_stage, split_model

# the inputs every stage is given (the others go to the first stage only, or are refused)
STAGE_KWARGS = ("attention_mask", "position_ids")


def split_for_rank(model: nn.Module, settings: PipelineSettings, pp_rank: int, pp: int) -> StageSplit:
    """`model` split in place into the stages pipeline rank `pp_rank` of `pp` holds under `settings`' schedule."""
    return split_model(model, held=settings.local_stages(pp_rank, pp), stages=settings.stage_count(pp),
                       layer_counts=settings.layers, ends_apart=settings.ends_apart)


class StageModule(nn.Module):
    """The module a `PipelineStage` runs: a stage's part of the model, called with `input_ids` (the first stage) or
    the received activations as `inputs_embeds`; returns the logits (the last stage) or the hidden states to send.
    It holds no parameters of its own. On a rank of one stage FSDP makes it the stage's root unit; on a rank of
    several (`split` given) each stage's module runs the one model with only its stage active (`active_stage`)."""

    def __init__(self, model: nn.Module, *, first: bool, split: StageSplit | None = None,
                 stage: int | None = None) -> None:
        super().__init__()
        self.model, self.first, self.split, self.stage = model, first, split, stage

    def forward(self, inputs: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        key = "input_ids" if self.first else "inputs_embeds"
        active = active_stage(self.model, self.split, self.stage) if self.split is not None else \
            contextlib.nullcontext()
        with active:
            outputs = self.model(**{key: inputs}, **kwargs, use_cache=False)
        out = outputs.logits if hasattr(outputs, "logits") else outputs[0]
        # a skipped head's "logits" are a slice of the hidden states: a view, which a zero-bubble schedule's input
        # pass cannot detach in place once it is done with the output
        return out.clone() if out._base is not None else out


class _Stage(PipelineStage):
    """torch's `PipelineStage`. In eval mode a V-shaped schedule of torch 2.13 still hands the gradient of its turn
    (the two adjacent stages on one rank) from one stage to the other, which a stage without a backward refuses:
    without a backward there is nothing to hand over, so the handoff is skipped."""

    def get_local_bwd_output(self, mb_index: int) -> Any:
        return super().get_local_bwd_output(mb_index) if self.has_backward else None

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


@dataclass(kw_only=True)
class _StepInputs:
    """The loss function's view of the micro-batch in flight."""

    grad_scale: float = 1.0
    label_smoothing: float = 0.0
    sums: list[torch.Tensor] = field(default_factory=list)


class Pipeline:
    """One rank's stage of the pipeline and its schedule (see the module docstring); built by `Pipeline.build`."""

    def __init__(self, *, model: nn.Module, split: StageSplit, stages: list[PipelineStage], schedule: Any,
                 pp_group: Any, tie_group: Any, microbatches: int, device: torch.device, pad_token: int,
                 split_backward: bool = False) -> None:
        self.model, self.split, self.stages, self.schedule = model, split, stages, schedule
        self.split_backward = split_backward  # a zero-bubble schedule: input-gradient and weight-gradient passes
        self.pp_group, self.tie_group, self.microbatches = pp_group, tie_group, microbatches
        self.device, self.pad_token = device, pad_token
        self._shape: tuple[int, int] | None = None  # the shape the stages inferred their activations' for
        self._step: tuple[int, int] | None = None  # the shape of the optimizer step in progress (`step_shape`)
        self._inputs = _StepInputs()

    @classmethod
    def build(cls, model: nn.Module, split: StageSplit, *, pp_mesh: Any, settings: PipelineSettings,
              device: torch.device, shard_root: Callable[[nn.Module], None]) -> Pipeline:
        """The rank's `PipelineStage`s and the schedule over `model` (split and laid out already).

        One stage per rank: `shard_root` makes the stage module the FSDP root, and the schedule reduces the
        gradients once, after the last microbatch. Several: the model stays FSDP's root (one model holds both
        stages), so its gradients are reduced after each microbatch's backward; a forward through the whole
        model first lets FSDP see every unit before any stage runs with part of it. A zero-bubble schedule's weight
        pass needs the weights its input pass used: they stay gathered from a stage's forward to the end of the
        schedule's step, where the gradients are reduced once (`_reduced_once`)."""
        group = pp_mesh.get_group()
        split_backward = settings.schedule in SPLIT_BACKWARD
        # FSDP warns that the model returns a view: a skipped head's "logits" are a slice of the hidden states,
        # which `StageModule` clones before anything else touches them (the warning's in-place case cannot arise)
        model_class = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__
        warnings.filterwarnings("ignore", category=UserWarning, message=re.escape(
            f"FSDP2-wrapped module (FSDP{model_class}) returned a view tensor"))
        if len(split.held) == 1:
            roots = [StageModule(model, first=split.is_first)]
            shard_root(roots[0])
        else:
            roots = [StageModule(model, first=stage == 0, split=split, stage=stage) for stage in split.held]
            _initialize_fsdp(model, split, device)
            if split_backward and isinstance(model, FSDPModule):
                model.set_reshard_after_forward(False)
        stages = [_Stage(root, stage, split.stages, device, group=group)
                  for root, stage in zip(roots, split.held, strict=True)]
        microbatches = settings.microbatches_for(pp_mesh.size())
        pipeline: Pipeline
        schedule_cls = getattr(torch_schedules, SCHEDULES[settings.schedule])
        schedule = schedule_cls(stages if settings.multi_stage else stages[0], n_microbatches=microbatches,
                                loss_fn=lambda out, target: pipeline._loss(out, target), scale_grads=False)
        tie_group = _tie_group(split, pp_mesh) if split.tied else None
        config = getattr(model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        pipeline = cls(model=model, split=split, stages=stages, schedule=schedule, pp_group=group,
                       tie_group=tie_group, microbatches=microbatches, device=device,
                       pad_token=pad if isinstance(pad, int) else 0, split_backward=split_backward)
        return pipeline

    @property
    def stage(self) -> PipelineStage:
        """The rank's first (on a single-stage schedule, only) `PipelineStage`."""
        return self.stages[0]

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
            # the stages infer the activations' shapes again (every rank at once: the shape is agreed); torch's
            # flags, of a schedule of one stage per rank and of several
            for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                         "_stages_forward_initialized", "_stages_backward_initialized"):
                if hasattr(self.schedule, flag):
                    setattr(self.schedule, flag, False)
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

    def describe(self) -> str:
        """Which stages this rank runs, e.g. "pipeline stages 1 and 3 of 4 (layers 1, 3) on rank 1"."""
        held = " and ".join(map(str, self.split.held))
        layers = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in self.split.layers)
        return (f"pipeline stage{'s' if len(self.split.held) > 1 else ''} {held} of {self.split.stages} (layers "
                f"{layers}) on rank {collectives.get_rank()}")

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """An error of the schedule (a peer gone, a collective timed out) names the stage it stopped."""
        try:
            yield
        except (torch.OutOfMemoryError, MemoryError):
            raise  # (auto_find_batch_size reads its type)
        except Exception as err:
            raise RuntimeError(f"{self.describe()}: {type(err).__name__}: {err}") from err

    @contextlib.contextmanager
    def _reduced_once(self) -> Iterator[None]:
        """Under a zero-bubble schedule, FSDP neither reduces nor reshards during the schedule's step (the weight
        passes add to the gathered weights' gradients after the input passes have run FSDP's hooks); after it the
        gradients are reduce-scattered once and the weights resharded: what torch's `PipelineStage` does for a
        stage module that is FSDP's root (`perform_reduce_grad`), here for the model, the root of both stages."""
        model = self.model
        if not self.split_backward or not isinstance(model, FSDPModule):
            yield
            return
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        model.set_is_last_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            model.set_is_last_backward(True)
        fully_shard.state(model)._root_post_backward_final_callback()

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
        with self._named(), self._reduced_once():
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
        with self._named():
            logits = self.schedule.eval(*args, target=targets if self.split.is_last else None, **kwargs)
        if not self.split.is_last:
            return torch.zeros((), device=self.device), None
        return torch.stack(self._inputs.sums[-self.microbatches:]).sum(), logits[:rows, :columns]

    def tied_parameter(self) -> nn.Parameter | None:
        """This stage's copy of tied embeddings (the first stage's embedding, the last's head), or None."""
        if not self.split.tied or not (self.split.is_first or self.split.is_last):
            return None
        model = self.model
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
    """The process group of the ranks of the first and the last stage at this rank's place in its stage (pipeline
    ranks 0 and pp - 1); collective."""
    pp = pp_mesh.size()
    if pp == 2:
        return pp_mesh.get_group()
    per_stage = dist.get_world_size() // pp
    pairs = [[rank, rank + (pp - 1) * per_stage] for rank in range(per_stage)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _initialize_fsdp(model: nn.Module, split: StageSplit, device: torch.device) -> None:
    """One forward of a token through every module `model` holds (no gradient), so that FSDP's root sees all its
    units before a stage's forward leaves some of them out (`active_stage`); collective over the FSDP ranks."""
    from shardtrain.parallel.fsdp import reshard_all

    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        if split.is_first:
            model(input_ids=token, use_cache=False)
        else:
            hidden = model.config.hidden_size
            model(inputs_embeds=torch.zeros((1, 1, hidden), device=device), use_cache=False)
    reshard_all(model)


def _pad(tensor: torch.Tensor, rows: int, columns: int, value: int) -> torch.Tensor:
    tensor = F.pad(tensor, (0, columns), value=value)
    if rows:
        tensor = torch.cat([tensor, tensor.new_full((rows, tensor.shape[1]), value)])
    return tensor
