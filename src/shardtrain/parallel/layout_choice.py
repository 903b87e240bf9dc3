"""Choosing the layout when `fsdp_config` says `"layout": "auto"`: the `LayoutChooser` seam.

The choice needs the planner (it traces the Trainer's step), which sits above the Trainer; the Trainer only
knows this protocol. The package's `__init__` registers the planner's chooser once, at the top, so no layer
imports upward:

    layout_choice.register("shardtrain.plan.auto_layout:AutoLayout.before_start")   # shardtrain/__init__.py
    chooser = layout_choice.before_start(spec, args, model, dataset)   # None unless "layout": "auto"
    runtime = Runtime.start(spec, model, chooser=chooser)  # every rank agrees; the spec is frozen with it

What a chooser decides (sharding, activation checkpointing, the loss chunk size, a pipeline with the accumulation
that keeps the global batch) ends up in the frozen `RunSpec` that the run reads; the user's `TrainingArguments`
are left as they were given.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from shardtrain.errors import FSDPConfigError


class LayoutChooser(Protocol):
    """A layout chosen for one run: traced before the process group starts, agreed on by every rank after."""

    def agree(self, spec: Any, backend: Any) -> Any:
        """Every rank: the same choice (rank 0's); returns `spec` (a `RunSpec`) with the chosen layout."""


# (spec, args, model, train_dataset, can_pipeline) -> LayoutChooser, called before the process group starts
ChooserFactory = Callable[[Any, Any, Any, Any, bool], LayoutChooser]
_factory: ChooserFactory | str | None = None


def register(factory: ChooserFactory | str) -> None:
    """Set the chooser that `"layout": "auto"` runs: a factory, or its "module:attribute" name, imported on the
    first run that asks (the package registers the planner's by name, so importing shardtrain stays light)."""
    global _factory
    _factory = factory


def before_start(spec: Any, args: Any, model: Any, train_dataset: Any,
                 can_pipeline: bool = False) -> LayoutChooser | None:
    """The registered chooser for this run when its `fsdp_config` asks for `"layout": "auto"`; else None.
    `can_pipeline`: the run's loss is the engine's own, so the chooser may split the model into a pipeline."""
    if spec.fsdp is None or spec.fsdp.layout != "auto":
        return None
    if _factory is None:
        raise FSDPConfigError("fsdp_config 'layout': \"auto\" needs the planner, which is not registered; import "
                              "shardtrain (its __init__ registers it) or set 'layout': \"manual\"")
    factory = _factory
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = importlib.import_module(module)
        for name in attribute.split("."):
            factory = getattr(factory, name)
    return factory(spec, args, model, train_dataset, can_pipeline)
