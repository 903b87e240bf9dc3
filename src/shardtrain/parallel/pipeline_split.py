"""A Hugging Face model split into pipeline stages by its own pipeline plan, in place, under its own names.

    split = split_model(model, held=(0,), stages=2)        # this rank's stage 0 of 2: the rest becomes Skipped
    split = split_model(model, held=(0, 2), stages=4)      # Interleaved 1F1B's rank 0 of 2: stages 0 and 2
    with active_stage(model, split, stage=3):              # a forward of stage 3 alone (a multi-stage rank)
        ...

The plan is transformers' own: `config.base_model_pp_plan` (embeddings, the list of layers, the final norm) and
the model's `_pp_plan` (the head). A module of a stage this rank does not hold becomes `Skipped` (no parameters,
passes its first input through), so the kept layers stay under their original indices and the rank's state-dict
keys are the full model's (a checkpoint resumes on any pipeline size). Layers are split evenly over the stages
(the first stages take one more where they do not divide). A rank that holds several stages (Interleaved 1F1B: r
and r + pp) keeps all their modules in one model; `active_stage` leaves only one
stage's in the forward path for the duration of a call.

Tied input and output embeddings on two ranks (the first and the last stage) each keep a whole copy (`TIED_ACROSS_
STAGES`: not tensor-parallel), their gradients summed over the pair.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardtrain.errors import PipelineError
from shardtrain.model_facts import TIED_ACROSS_STAGES, base_model

STAGE_ATTR = "_shardtrain_pipeline_stage"  # the `StageSplit` a split model carries


class Skipped(nn.Module):
    """A module of another pipeline stage: no parameters; passes its first input through (a layer's hidden
    states, the norm's input, the head's input)."""

    pipeline_skipped = True  # (read by the layout's stages: nothing to shard or wrap here)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """What one rank holds of the pipeline.

    Attributes:
        held: the stages this rank holds (one; two under a multi-stage schedule), in schedule order.
        stages: the pipeline's stages (pp_size x stages per rank).
        layers: the decoder layers (original indices) of each held stage.
        tied: the model's tied input and output embeddings live on two ranks (first stage: the embedding, last:
            the head), their gradients summed over the pair.
        tied_names: (the embedding's weight name, the head's) of a tied model: a checkpoint holds the pair under
            the embedding's name, as one process saves its optimizer state.
    """

    held: tuple[int, ...]
    stages: int
    layers: tuple[range, ...]
    tied: bool
    tied_names: tuple[str, str] | None = None

    @property
    def stage(self) -> int:
        """The first stage held (the only one of a single-stage schedule)."""
        return self.held[0]

    @property
    def is_first(self) -> bool:
        return 0 in self.held

    @property
    def is_last(self) -> bool:
        return self.stages - 1 in self.held


def stage_split(model: nn.Module) -> StageSplit | None:
    """The stages a split model holds (`split_model`), or None."""
    return getattr(model, STAGE_ATTR, None)


def layer_ranges(num_layers: int, stages: int) -> list[range]:
    """An even split of `num_layers` over `stages` (the first stages take one more where it does not divide)."""
    each, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        end = start + each + (stage < extra)
        ranges.append(range(start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class _Plan:
    base: nn.Module
    before: list[str]  # the base model's modules before the layers (embeddings)
    layers: str
    after: list[tuple[nn.Module, str]]  # (owner, name) after the layers: the final norm, then the head


def _pipeline_plan(model: nn.Module) -> _Plan:
    """The model's pipeline plan (see the module docstring).

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
    head = [(model, n) for n in (getattr(model, "_pp_plan", None) or {}) if isinstance(getattr(model, n, None),
                                                                                          nn.Module)]
    return _Plan(base=base, before=names[:at], layers=lists[0], after=[(base, n) for n in names[at + 1:]] + head)




def split_model(model: nn.Module, *, held: Sequence[int], stages: int,
                layer_counts: Sequence[int] | None = None, ends_apart: bool = True) -> StageSplit:
    """Keep, in place, what the stages `held` of `stages` run (see the module docstring); every other module of
    the plan becomes `Skipped`. The model carries the `StageSplit` (`stage_split`).
    `layer_counts`: the decoder layers of each stage, in order (`pp_layers`); None: an even split.
    `ends_apart`: the first and the last stage are on two ranks (False under a V-shaped schedule, whose rank 0
    holds both: tied embeddings stay one parameter there, as in one process).

    Raises:
        PipelineError: a model without a pipeline plan, or fewer layers than stages.
    """
    inner = base_model(model)  # a PEFT model is split through its base model; names (and the record) are the outer's
    plan = _pipeline_plan(inner)
    layers = getattr(plan.base, plan.layers)
    if len(layers) < stages:
        raise PipelineError(f"{type(inner).__name__} has {len(layers)} layers, fewer than the {stages} pipeline "
                            f"stages (each needs one at least); use a smaller pp_size, or a single-stage schedule")
    first, last = 0 in held, stages - 1 in held
    embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    weights = getattr(embedding, "weight", None), getattr(head, "weight", None)
    # the config says so too (every rank reads the same one: a model moved to the meta device on some ranks may
    # hold the pair as two parameters there)
    tied_model = None not in weights and (weights[0] is weights[1] or (
        getattr(inner.config, "tie_word_embeddings", False) and weights[0].shape == weights[1].shape))
    tied_names = None
    if tied_model:
        names = {id(m): n for n, m in model.named_modules()}
        tied_names = (f"{names[id(embedding)]}.weight", f"{names[id(head)]}.weight")
    tied = tied_model and stages > 1 and ends_apart
    if tied:  # each end keeps its copy whole (not tensor-parallel), as a tied pair is in one process
        setattr(embedding, TIED_ACROSS_STAGES, True)
        setattr(head, TIED_ACROSS_STAGES, True)
    if layer_counts is not None and sum(layer_counts) != len(layers):
        raise PipelineError(f"pp_layers = {list(layer_counts)} adds up to {sum(layer_counts)} layers, but "
                            f"{type(inner).__name__} has {len(layers)}; give the stages {len(layers)} in all")
    ranges = layer_ranges(len(layers), stages) if layer_counts is None else \
        [range(sum(layer_counts[:i]), sum(layer_counts[:i + 1])) for i in range(stages)]
    kept = tuple(ranges[stage] for stage in held)
    for index in range(len(layers)):
        if not any(index in r for r in kept):
            layers[index] = Skipped()
    for name in plan.before if not first else ():
        setattr(plan.base, name, Skipped())
    for owner, name in plan.after if not last else ():
        setattr(owner, name, Skipped())
    split = StageSplit(held=tuple(held), stages=stages, layers=kept, tied=tied,
                       tied_names=tied_names if tied else None)
    setattr(model, STAGE_ATTR, split)
    return split


@contextlib.contextmanager
def active_stage(model: nn.Module, split: StageSplit, stage: int) -> Iterator[None]:
    """For the duration of a call, the forward path of `model` (which holds several stages) is stage `stage`'s
    alone: the other held stages' layers, and the norm and head unless `stage` is the last, are `Skipped`."""
    plan = _pipeline_plan(base_model(model))
    layers = getattr(plan.base, plan.layers)
    keep = split.layers[split.held.index(stage)]
    swapped: list[tuple[Any, Any, Any]] = []  # (owner, key, module) to put back
    skip = Skipped()
    for other in split.layers:
        for index in other if other != keep else ():
            swapped.append((layers, index, layers[index]))
            layers[index] = skip
    if stage != split.stages - 1:
        for owner, name in plan.after:
            swapped.append((owner, name, getattr(owner, name)))
            setattr(owner, name, skip)
    try:
        yield
    finally:
        for owner, key, module in reversed(swapped):
            if isinstance(key, int):
                owner[key] = module
            else:
                setattr(owner, key, module)


def published_aliases(model: nn.Module) -> dict[str, str]:
    """Checkpoint name -> this rank's parameter name, for the entries a rank publishes under another name: the
    last stage's copy of tied embeddings on another rank than the first's goes under the embedding's name (as one
    process saves its optimizer state), so that checkpoints of any pipeline size hold the same keys."""
    split = stage_split(model)
    if split is None or split.tied_names is None or not split.is_last or split.is_first:
        return {}
    embedding, head = split.tied_names
    return {embedding: head}
