"""The runtime of a run: the processes (through the backend), the parallel layout (`ParallelDims` and its named
meshes), context parallelism and the device, started once from the run description.

    runtime = Runtime.start(spec, model)   # spec: config.run_spec.RunSpec; model: a module, a path or None
    runtime.meshes.fsdp, runtime.dims.cp, runtime.backend.all_reduce(t)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardtrain.config.run_spec import RunSpec
from shardtrain.parallel.backend import TrainingBackend
from shardtrain.parallel.context import ContextParallel
from shardtrain.parallel.dims import Meshes, ParallelDims
from shardtrain.parallel.layout import Layout
from shardtrain.parallel.layout_choice import LayoutChooser
from shardtrain.parallel.pipeline_settings import PipelineSettings, check_settings


def make_backend(spec: RunSpec) -> TrainingBackend:
    """The backend the run description asks for: XLA when fsdp is on and `fsdp_config` sets `"xla": true`, else
    FSDP2 (torch_xla is imported only then)."""
    if spec.xla:
        from shardtrain.parallel.xla import XlaBackend

        return XlaBackend(spec)
    return TrainingBackend(spec)


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Everything about where a run executes (see module docstring).

    Attributes:
        spec: the run description it was started from.
        backend: FSDP2 (CPU/GPU) or PyTorch/XLA; collectives on host-visible values go through it.
        dims, meshes: the parallel sizes and their meshes by purpose (`batch`, `fsdp`, `loss`, `cp`, `tp`, ...).
        cp: context parallelism, or None when `dims.cp` is 1.
        rank, world_size, device: this process, the number of processes, where the model and batches live.
        dp_rank: which share of the samples this rank sees (its coordinate on the `batch` mesh).
    """

    spec: RunSpec
    backend: TrainingBackend
    dims: ParallelDims
    meshes: Meshes
    cp: ContextParallel | None
    rank: int
    world_size: int
    device: torch.device
    dp_rank: int

    def layout(self) -> Layout:
        """The run's parallel layout, as its description (`RunSpec`) says: what `apply_layout` applies."""
        spec = self.spec
        return Layout(meshes=self.meshes, dims=self.dims, fsdp=spec.fsdp, tp_plan=spec.tp_plan,
                      mixed_precision=spec.mixed_precision, compile_options=spec.compile_options, cp=self.cp,
                      pipeline=PipelineSettings.of(spec))

    @classmethod
    def start(cls, spec: RunSpec, model: Any = None, chooser: LayoutChooser | None = None) -> Runtime:
        """Set up the processes and meshes `spec` describes; refuse (on every rank) a `model` or a setting the
        backend cannot run, before the model is touched. `chooser` (`layout_choice.before_start`'s, traced before
        the process group starts): the runtime's spec is `spec` with the layout every rank agrees on, frozen."""
        backend = make_backend(spec)
        backend.setup()
        if chooser is not None:
            spec = chooser.agree(spec, backend)
        dims = ParallelDims.resolve(world_size=backend.world_size, fsdp_config=spec.fsdp,
                                    local_world_size=spec.local_world_size or backend.world_size, **spec.sizes)
        if dims.pp > 1:  # before the meshes: a schedule that cannot run is one line on every rank
            check_settings(PipelineSettings.of(spec), pp=dims.pp)
        meshes = dims.build(backend.host_device_type)
        backend.check(model, dims)
        cp = ContextParallel(meshes.cp, recompute=spec.cp_regather_kv) if dims.cp > 1 else None
        return cls(spec=spec, backend=backend, dims=dims, meshes=meshes, cp=cp, rank=backend.rank,
                   world_size=backend.world_size, device=backend.device,
                   dp_rank=dims.rank_coords(backend.rank)["batch"])

    @property
    def collects_predictions(self) -> bool:
        """Whether this rank contributes predictions: one rank of each group that shares its samples (cp, tp)."""
        coords = self.dims.rank_coords(self.rank)
        return coords["cp"] == 0 and coords["tp"] == 0 and coords["pp"] == self.dims.pp - 1
