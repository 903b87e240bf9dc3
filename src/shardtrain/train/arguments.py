"""`TrainingArguments`: a `transformers.TrainingArguments` subclass, validated when constructed.

    args = TrainingArguments("out", per_device_train_batch_size=4, fsdp=True)   # positional output_dir, as HF
    parser = HfArgumentParser((ModelArguments, DataArguments, shardtrain.TrainingArguments))

Every field, default, enum conversion and helper is Hugging Face's (the class *is* one); shardtrain adds a few
fields (`OURS`), checks every field it implements first with a message naming the field and the fix, then runs
Hugging Face's `__post_init__` with two things kept out of it: its FSDP plugin (shardtrain's engine applies
FSDP2 itself: `fsdp_config` becomes an `FSDPConfig`, `fsdp_enabled` says whether it is on) and its device
setup through Accelerate's `PartialState` (`_setup_devices` is overridden: the Trainer's backend creates the
process group; `args.device`, `world_size` and `process_index` read torchrun's environment).

The launcher's settings (`shardtrain.config.env`: FSDP on/off and its config, mixed precision, cp size) apply
to the fields left unset: an argument the user passed wins, even `fsdp=False` or `bf16=False`. A Hugging Face
field shardtrain does not implement either has no effect (one warning names them) or is refused
(`hf_compat.REFUSED`), so a run never silently differs from what its arguments say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import transformers

from shardtrain.config import env
from shardtrain.config.cluster import adopt_srun_environment
from shardtrain.config.fsdp_config import FSDPConfig, parse_fsdp_option
from shardtrain.errors import (
    FSDPConfigError,
    NotImplementedArgumentError,
    TrainingArgumentsError,
    UserError,
    install_error_hook,
)
from shardtrain.train import verify
from shardtrain.train.args import hf_fields as hf_compat
from shardtrain.train.args.checks import (  # noqa: F401 (the vocabularies: re-exported)
    COMPILE_MODES,
    OPTIMIZERS,
    SCHEDULERS,
    STRATEGIES,
    UNSET,
    check_choices,
    check_conflicts,
    check_numbers,
    check_types,
    fail,
)

# Hugging Face fields shardtrain implements with Hugging Face's meaning (the compatibility table says "supported")
IMPLEMENTED_HF = frozenset({
    "output_dir", "do_train", "do_eval", "do_predict", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "optim", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "max_steps", "num_train_epochs",
    "train_sampling_strategy", "log_level", "log_level_replica", "skip_memory_metrics", "label_names",
    "auto_find_batch_size", "dataloader_drop_last",
    "max_grad_norm", "bf16", "fp16", "seed", "data_seed", "logging_strategy", "logging_steps", "logging_first_step",
    "eval_strategy", "eval_steps", "eval_on_start", "prediction_loss_only", "save_strategy", "save_steps",
    "save_total_limit", "save_only_model", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "resume_from_checkpoint", "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
    "activation_checkpointing_kwargs", "fsdp", "fsdp_config", "report_to", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_prefetch_factor", "remove_unused_columns", "disable_tqdm", "use_cpu",
    "ddp_timeout", "parallelism_config", "torch_compile", "torch_compile_backend", "torch_compile_mode",
    "label_smoothing_factor", "neftune_noise_alpha", "logging_nan_inf_filter", "enable_jit_checkpoint", "tf32",
    "torch_empty_cache_steps", "use_cache", "average_tokens_across_devices", "run_name", "project",
    "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "batch_eval_metrics", "include_for_metrics",
    "eval_delay", "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
    "hub_revision",
})


def _help(text: str) -> dict[str, Any]:
    return field(default=None, metadata={"help": text})


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """Training settings: every field of `transformers.TrainingArguments`, and a few of ours.

    After construction `fsdp_config` is an `FSDPConfig`, `fsdp_enabled` says whether FSDP2 is applied,
    `bf16`/`fp16` are booleans and `report_to` a list. See the module docstring and the compatibility
    table for what each Hugging Face field does here.
    """

    # Hugging Face's fields whose unset value means "the launcher's setting" (their default is False)
    bf16: bool = field(default=UNSET, metadata={"help": "bf16 mixed precision (unset: the launcher's choice)"})
    fp16: bool = field(default=UNSET, metadata={"help": "fp16 mixed precision (unset: the launcher's choice)"})
    # Hugging Face's since transformers 5.24 (gradient_checkpointing's new name); declared for older releases
    activation_checkpointing: bool | None = _help("activation checkpointing (under FSDP: FSDP's own, per layer)")
    activation_checkpointing_kwargs: dict | str | None = _help("kwargs of the model's gradient_checkpointing_enable")
    # shardtrain's own
    cp_size: int | None = _help("context-parallel size (causal LMs: sequences split over cp ranks)")
    cp_regather_kv: bool = field(default=True, metadata={"help": "context parallel: all-gather K/V again in "
                                                                 "backward instead of keeping them"})
    sp_size: int = field(default=1, metadata={"help": "Ulysses sequence-parallel size (not supported above 1)"})
    tp_size: int | None = _help("tensor-parallel size (the model's own TP plan)")
    tp_plan: dict | None = _help("module-name pattern -> transformers TP style; default: the model's plan")
    ep_size: int | None = _help("expert-parallel size (MoE experts spread over ep ranks)")
    pp_size: int | None = _help("pipeline-parallel size (the model's layers split into pp stages)")
    pp_schedule: str = field(default="1F1B", metadata={"help": "pipeline schedule: GPipe, 1F1B, Interleaved1F1B, "
                                                                 "LoopedBFS"})
    pp_microbatches: int | None = _help("pipeline microbatches per micro-batch (default: the stages in flight)")
    pp_layers: list[int] | None = _help("decoder layers of each pipeline stage, in order (default: even)")
    save_async: bool = field(default=False, metadata={"help": "write checkpoints in the background"})
    loss_chunk_size: int | str | None = _help("tokens per chunk of LM head + cross entropy; 'auto'; None: off")
    pack_sequences: bool = field(default=False, metadata={"help": "pack each training micro-batch into one row "
                                                                  "(no padding; documents kept apart)"})
    step_guard: dict | str | None = _help("skip non-finite (opt-in: spiking) steps on every rank; true or "
                                                 "{spike_factor, window, max_in_a_row}")
    fault_tolerance: dict | str | None = _help("replica groups on torchft: {replica_group, replica_groups, "
                                               "lighthouse, ...} (docs/fault-tolerance.md)")
    # as Hugging Face's Seq2SeqTrainingArguments
    predict_with_generate: bool = field(default=False, metadata={"help": "evaluate/predict generate answers"})
    generation_max_length: int | None = _help("generation: maximum total length")
    generation_num_beams: int | None = _help("generation: number of beams")
    fsdp_enabled: bool = field(init=False, default=False)
    parallel_sizes: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        install_error_hook()  # a bad argument is one `error:` line, not a traceback
        adopt_srun_environment()  # `srun python train.py` (a task per device): torchrun's variables from Slurm's
        if (wanted := verify.request()) is not None:  # under `shardtrain verify`: K steps, measured, nothing kept
            verify.apply_request(self, wanted)
        check_types(self)
        self._resolve_parallelism()  # the sizes the parallelism_config and the launcher give, checked next
        check_numbers(self)
        check_choices(self)
        self._resolve_fsdp()
        check_conflicts(self)
        self._check_mirrored()
        self._hf_post_init()

    _composed_from: ClassVar[type | None] = None  # the library's class, on a class `arguments_on_engine` built

    def __reduce__(self) -> Any:
        """A composed class (`arguments_on_engine`) is built at run time, so it pickles as the library's class it
        was composed from (importable) and unpickles into the engine's again (a library's `torch.save(args)`)."""
        if type(self)._composed_from is None:
            return super().__reduce__()
        return _compose_again, (type(self)._composed_from, dict(self.__dict__))

    def _hf_post_init(self) -> None:
        """Hugging Face's `__post_init__` (enums, derived values, accelerator_config, tf32, `self.device`) on the
        values resolved above, without its FSDP plugin and its GPU-only bf16 check; ours are put back after."""
        kept = {name: getattr(self, name) for name in (
            "fsdp", "fsdp_config", "bf16", "fp16", "report_to", "gradient_checkpointing", "activation_checkpointing",
            "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")}
        self.fsdp, self.fsdp_config, self.bf16, self.fp16 = None, None, False, False
        # the new names set and the old ones None: Hugging Face copies new -> old without a deprecation warning
        self.activation_checkpointing = bool(kept["activation_checkpointing"] or kept["gradient_checkpointing"])
        self.activation_checkpointing_kwargs = kept["activation_checkpointing_kwargs"]
        self.gradient_checkpointing = self.gradient_checkpointing_kwargs = None
        try:
            super().__post_init__()
        except (ValueError, NotImplementedError) as err:
            if isinstance(err, UserError):
                raise
            kind = NotImplementedArgumentError if isinstance(err, NotImplementedError) else TrainingArgumentsError
            raise kind(f"TrainingArguments: {err}") from None
        finally:
            for name, value in kept.items():
                setattr(self, name, value)
        self.mixed_precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    # -- Hugging Face's device and process properties, from torchrun's environment (no Accelerate state) --
    @cached_property
    def _setup_devices(self) -> Any:
        from shardtrain.parallel.distributed import LaunchedProcesses, current_device

        # shardtrain's backend owns the process group (no Accelerate PartialState that would create one); the
        # launcher's facts stand in for it
        self.distributed_state = LaunchedProcesses.from_environment()
        device = current_device()
        self._n_gpu = 1 if device.type == "cuda" else 0
        return device

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)

    @property
    def process_index(self) -> int:
        return int(os.environ.get("RANK", "0") or 0)

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    @property
    def parallel_mode(self) -> Any:
        from transformers.training_args import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Rank 0 runs the body first (e.g. dataset preprocessing with a cache), then the others."""
        import torch.distributed as dist

        active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank = self.local_process_index if local else self.process_index
        if active and rank != 0:
            dist.barrier()
        try:
            yield
        finally:
            if active and rank == 0:
                dist.barrier()

    def to_dict(self) -> dict[str, Any]:
        """Hugging Face's dict, with the parsed FSDP config as its dict and what was resolved from it and the
        launcher (`fsdp_enabled`, `parallel_sizes`)."""
        out = super().to_dict()
        if isinstance(self.fsdp_config, FSDPConfig):
            out["fsdp_config"] = self.fsdp_config.to_dict()
        out.update(fsdp_enabled=self.fsdp_enabled, parallel_sizes=dict(self.parallel_sizes))
        return out

    # -- what the Trainer reads -------------------------------------------------------------------------
    def interval(self, name: str, max_steps: int) -> int:
        """`logging_steps` / `save_steps` / `eval_steps` in steps: a value below 1 is a ratio of `max_steps`."""
        value = getattr(self, name)
        if name == "eval_steps" and value is None:  # Hugging Face: evaluate every logging_steps
            value = self.logging_steps
        return max(1, math.ceil(value * max_steps)) if value < 1 else int(value)

    def warmup_for(self, max_steps: int) -> int:
        """Warmup steps: `warmup_steps` when >= 1, else that ratio of `max_steps` (as transformers 5)."""
        return int(self.warmup_steps) if self.warmup_steps >= 1 else math.ceil(self.warmup_steps * max_steps)

    # -- validation --------------------------------------------------------------------------------------
    def _resolve_parallelism(self) -> None:
        """`parallel_sizes` from, key by key: `cp_size`/`tp_size`/`ep_size`/`pp_size` or `parallelism_config` (the
        script), else the launcher's SHARDTRAIN_PARALLELISM; the script wins. Unset sizes are left to ParallelDims."""
        from shardtrain.config.parallelism import from_env, read_parallelism
        from shardtrain.errors import ParallelismError

        try:
            script, _ = read_parallelism(self.parallelism_config, "TrainingArguments.parallelism_config")
            launcher = from_env()
        except ParallelismError as err:
            raise TrainingArgumentsError(str(err)) from err
        for name in ("cp_size", "tp_size", "ep_size", "pp_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, f"must be a positive int, got {value!r}")
            if script.get(name, value) != value:
                fail(name, f"= {value} but parallelism_config.{name} = {script[name]}; set only one of them")
            script[name] = value
        self.parallel_sizes = {**launcher, **script}
        for name in ("cp_size", "tp_size", "ep_size", "pp_size"):
            setattr(self, name, self.parallel_sizes.get(name, 1))

    def _resolve_fsdp(self) -> None:
        """FSDP and mixed precision from the arguments, else `shardtrain launch`'s variables, else those of
        `accelerate launch` (`shardtrain.config.accelerate_env`)."""
        from shardtrain.config.accelerate_env import from_environment
        from shardtrain.errors import LaunchConfigError

        try:
            ours = env.env_flag(env.USE_FSDP) or bool(os.environ.get(env.FSDP_CONFIG))
            accelerate = from_environment(os.environ)
        except (env.EnvError, LaunchConfigError) as err:
            raise TrainingArgumentsError(str(err)) from None
        if accelerate.ignored and self.process_index == 0:
            warnings.warn(f"ignoring Accelerate settings with no FSDP2 meaning: {', '.join(accelerate.ignored)}",
                          stacklevel=4)
        if accelerate.use_cpu and not self.use_cpu:
            self.use_cpu = True
        env_fsdp = self.fsdp is None and (ours or accelerate.use_fsdp)
        try:
            enabled, overrides = parse_fsdp_option(self.fsdp)
            source = self.fsdp_config
            if source is None and os.environ.get(env.FSDP_CONFIG):
                try:
                    source = json.loads(os.environ[env.FSDP_CONFIG])
                except json.JSONDecodeError as err:
                    raise FSDPConfigError(f"environment variable {env.FSDP_CONFIG} is not valid JSON ({err}); "
                                          "unset it or let `shardtrain launch` set it") from None
            elif source is None and accelerate.use_fsdp and not ours:
                source = dict(accelerate.fsdp)
            config = FSDPConfig.load(source)
            for key, value in overrides.items():
                if key == "sharding_strategy":
                    config.apply_sharding_strategy(value)
                else:
                    setattr(config, key, value)
        except FSDPConfigError as err:
            raise TrainingArgumentsError(f"TrainingArguments.fsdp_config: {err}") from None
        if self.activation_checkpointing and not config.activation_checkpointing:  # keeps fsdp_config "selective"
            config.activation_checkpointing = True
        self.fsdp_enabled = enabled or env_fsdp
        if (not self.fsdp_enabled and self.fsdp is None and source is None and self.world_size > 1
                and os.environ.get(env.USE_FSDP) is None and not os.environ.get(env.LAUNCHED)):
            # several processes and no word of FSDP (a transformers script under plain torchrun): data parallelism,
            # as transformers' DDP runs it, i.e. FSDP2 holding whole parameters (no_shard). fsdp=False, or
            # `shardtrain launch` with FSDP off, is refused on several ranks
            config.apply_sharding_strategy("no_shard")
            self.fsdp_enabled = True
        self.fsdp_config = config
        if self.bf16 is UNSET and self.fp16 is UNSET:
            chosen = config.mixed_precision or os.environ.get(env.MIXED_PRECISION) or accelerate.mixed_precision
            if chosen not in (None, "", "no", "bf16", "fp16"):
                fail("bf16", f"/fp16 come from {env.MIXED_PRECISION}={chosen!r}, which is not no|bf16|fp16")
            self.bf16, self.fp16 = chosen == "bf16", chosen == "fp16"
        self.bf16, self.fp16 = bool(self.bf16), bool(self.fp16)

    def _check_mirrored(self) -> None:
        notes, refused = hf_compat.check_mirrored(self, IMPLEMENTED)
        if refused:
            raise TrainingArgumentsError(refused)
        if notes and self.process_index == 0:
            for note in notes:
                warnings.warn(note, stacklevel=4)


OURS, NOTES = hf_compat.OUR_FIELDS, hf_compat.FIELD_NOTES  # our fields; what the compatibility table says of some
IMPLEMENTED = IMPLEMENTED_HF | OURS


def compatibility_markdown() -> str:
    """The compatibility table (docs/hugging-face.md): every Hugging Face TrainingArguments field and ours, with
    what each does here."""
    return hf_compat.compatibility_table(hf_compat.compatibility_rows(IMPLEMENTED - OURS, OURS, NOTES))


@functools.cache
def arguments_on_engine(arguments_cls: type) -> type:
    """`arguments_cls` (a `transformers.TrainingArguments` dataclass subclass) with shardtrain's fields and
    checks; cached per class."""
    if not (isinstance(arguments_cls, type) and issubclass(arguments_cls, transformers.TrainingArguments)):
        raise TrainingArgumentsError(
            f"arguments_on_engine() takes a transformers.TrainingArguments subclass, got {arguments_cls!r}")
    if issubclass(arguments_cls, TrainingArguments):
        return arguments_cls
    if arguments_cls is transformers.TrainingArguments:
        return TrainingArguments
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": arguments_cls.__qualname__,
                                 "__doc__": arguments_cls.__doc__, "_composed_from": arguments_cls}
    return dataclasses.dataclass(type(arguments_cls.__name__, (arguments_cls, TrainingArguments), namespace))


def take_accumulation_from_accelerator_config(args: TrainingArguments) -> None:
    """Hugging Face's rule (its Trainer's, at construction): `accelerator_config.gradient_accumulation_kwargs`'s
    `num_steps` becomes `gradient_accumulation_steps`, which must then be left at 1."""
    # (no accelerator_config where Accelerate is not installed: transformers leaves it None)
    steps = (getattr(args.accelerator_config, "gradient_accumulation_kwargs", None) or {}).get("num_steps")
    if steps is None:
        return
    if args.gradient_accumulation_steps > 1:
        raise TrainingArgumentsError(
            "The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is greater than 1 in the "
            f"passed `TrainingArguments` ({steps} and {args.gradient_accumulation_steps}); set one of them: "
            "TrainingArguments.gradient_accumulation_steps, or accelerator_config's gradient_accumulation_kwargs")
    args.gradient_accumulation_steps = int(steps)


def _compose_again(arguments_cls: type, state: dict[str, Any]) -> TrainingArguments:
    """Unpickle arguments of `arguments_on_engine(arguments_cls)` (see `TrainingArguments.__reduce__`)."""
    args = object.__new__(arguments_on_engine(arguments_cls))
    args.__dict__.update(state)
    return args
