"""The run description: what the engine runs, resolved once from `TrainingArguments`, the launcher's environment
and `parallelism_config`, and frozen. The Trainer builds it in its constructor; the parts below the Trainer (the
backend, model preparation, the logger, resume) read it, never `TrainingArguments` or `os.environ`.

    spec = RunSpec.resolve(args)                 # args: shardtrain.TrainingArguments (validated)
    backend = make_backend(spec)                 # FSDP2, or PyTorch/XLA when spec.fsdp.xla

What it leaves to `TrainingArguments`: the hyperparameters of a `train()` call (learning rate, batch sizes, steps,
seed of the data order, ...), which Hugging Face's `hyperparameter_search` sets on the arguments between trials.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shardtrain.config import env
from shardtrain.config.fault_tolerance import FaultTolerance
from shardtrain.config.fsdp_config import FSDPConfig


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What the engine runs (see module docstring).

    Attributes:
        output_dir: the run's directory (checkpoints, metrics.jsonl).
        fsdp: the parsed `fsdp_config` (a copy), or None when FSDP is off.
        sizes: the parallel sizes asked for (`dp_replicate`, `dp_shard`, `cp`, `tp`, `ep`; absent: derived).
        world_size, local_world_size, restart_count: the launcher's `WORLD_SIZE`, `LOCAL_WORLD_SIZE` (None: not
            launched) and `TORCHELASTIC_RESTART_COUNT`.
        ddp_timeout: seconds a collective may wait for a peer.
        mixed_precision: "bf16", "fp16" or "no".
        tp_plan: the user's tensor-parallel plan, or None (the model's own).
        compile_options: `torch.compile` options per FSDP unit, or None (eager).
        gradient_checkpointing: kwargs for the model's `gradient_checkpointing_enable`, or None (off).
        cp_regather_kv: context parallel: all-gather K/V again in backward instead of keeping them.
        save_async: checkpoints written in the background.
        seed: the run's seed (the XLA runtime's RNG).
        pp_schedule, pp_microbatches, pp_layers: the pipeline's schedule (a name of
            `parallel.pipeline_settings.SCHEDULES`), the microbatches each micro-batch is split into (None: as many
            as the pipeline has stages) and the decoder layers of each stage (None: an even split).
        fault_tolerance: the replica groups this job is one of (`parallel.replicas.FaultTolerance`), or None.
        loss_chunk_size: tokens per chunk of the LM head and its cross entropy, "auto", or None (off); an
            automatic layout may choose it (`parallel.layout_choice`).
        accumulation_factor: the arguments' accumulation steps are taken this many times: an automatic layout that
            chose a pipeline of pp stages has pp times fewer data-parallel ranks, and keeps the global batch so.
    """

    output_dir: Path
    fsdp: FSDPConfig | None
    sizes: Mapping[str, int]
    world_size: int = 1
    local_world_size: int | None = None
    restart_count: int = 0
    ddp_timeout: int = 1800
    mixed_precision: str = "no"
    tp_plan: Mapping[str, str] | None = None
    compile_options: Mapping[str, str] | None = None
    gradient_checkpointing: Mapping[str, Any] | None = None
    cp_regather_kv: bool = True
    save_async: bool = False
    seed: int = 42
    loss_chunk_size: int | str | None = None
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    pp_layers: tuple[int, ...] | None = None
    fault_tolerance: FaultTolerance | None = None
    accumulation_factor: int = 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp is not None

    @property
    def xla(self) -> bool:
        """PyTorch/XLA instead of FSDP2 (`fsdp_config` `"xla": true`)."""
        return self.fsdp is not None and bool(self.fsdp.xla)

    @classmethod
    def resolve(cls, args: Any, environ: Mapping[str, str] | None = None) -> RunSpec:
        """The description of `args` (a validated `shardtrain.TrainingArguments`) under `environ` (default: this
        process's environment)."""
        environ = os.environ if environ is None else environ
        compile_options = None
        if args.torch_compile:
            compile_options = {"backend": args.torch_compile_backend or "inductor",
                               **({"mode": args.torch_compile_mode} if args.torch_compile_mode else {})}
        checkpointing = None
        if args.gradient_checkpointing:
            checkpointing = {"use_reentrant": False, **(args.gradient_checkpointing_kwargs or {})}
        local = environ.get(env.LOCAL_WORLD_SIZE)
        return cls(
            output_dir=Path(args.output_dir),
            fsdp=copy.deepcopy(args.fsdp_config) if args.fsdp_enabled else None,
            sizes=_frozen({name.removesuffix("_size"): size for name, size in args.parallel_sizes.items()}),
            world_size=int(environ.get(env.WORLD_SIZE) or 1), local_world_size=int(local) if local else None,
            restart_count=int(environ.get(env.RESTART_COUNT) or 0), ddp_timeout=args.ddp_timeout,
            mixed_precision=args.mixed_precision, tp_plan=_frozen(args.tp_plan),
            compile_options=_frozen(compile_options), gradient_checkpointing=_frozen(checkpointing),
            cp_regather_kv=args.cp_regather_kv, save_async=args.save_async, seed=args.seed,
            loss_chunk_size=args.loss_chunk_size, pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches,
            pp_layers=tuple(args.pp_layers) if args.pp_layers is not None else None,
            fault_tolerance=FaultTolerance.resolve(args.fault_tolerance, environ))


def _frozen(mapping: Mapping | None) -> Mapping | None:
    return None if mapping is None else MappingProxyType(dict(mapping))
