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
import json
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import transformers

from shardtrain.config import env
from shardtrain.config.fsdp_config import FSDPConfig, parse_fsdp_option
from shardtrain.errors import FSDPConfigError, TrainingArgumentsError, UserError, install_error_hook
from shardtrain.train import hf_compat

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
STRATEGIES = ("no", "steps", "epoch")
# torch optimizers whose update is elementwise, so a sharded parameter steps exactly as a whole one would
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "sgd", "adagrad", "rmsprop")
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")

# Hugging Face fields shardtrain implements with Hugging Face's meaning (the README table says "supported")
IMPLEMENTED_HF = frozenset({
    "output_dir", "do_train", "do_eval", "do_predict", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "optim", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "max_steps", "num_train_epochs",
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
})


class _Unset:
    """Default of a field that the launcher's environment may set: distinguishable from an explicit False."""

    def __repr__(self) -> str:
        return "unset"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


def _help(text: str) -> dict[str, Any]:
    return field(default=None, metadata={"help": text})


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """Training settings: every field of `transformers.TrainingArguments`, and a few of ours.

    After construction `fsdp_config` is an `FSDPConfig`, `fsdp_enabled` says whether FSDP2 is applied,
    `bf16`/`fp16` are booleans and `report_to` a list. See the module docstring and README's compatibility
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
    save_async: bool = field(default=False, metadata={"help": "write checkpoints in the background"})
    loss_chunk_size: int | str | None = _help("tokens per chunk of LM head + cross entropy; 'auto'; None: off")
    pack_sequences: bool = field(default=False, metadata={"help": "pack each training micro-batch into one row "
                                                                  "(no padding; documents kept apart)"})
    # as Hugging Face's Seq2SeqTrainingArguments
    predict_with_generate: bool = field(default=False, metadata={"help": "evaluate/predict generate answers"})
    generation_max_length: int | None = _help("generation: maximum total length")
    generation_num_beams: int | None = _help("generation: number of beams")
    fsdp_enabled: bool = field(init=False, default=False)
    parallel_sizes: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        install_error_hook()  # a bad argument is one `error:` line, not a traceback
        self._check_types()
        self._check_numbers()
        self._check_choices()
        self._resolve_fsdp()
        self._check_conflicts()
        self._check_mirrored()
        self._hf_post_init()

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
            raise TrainingArgumentsError(f"TrainingArguments: {err}") from None
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
    def _fail(self, name: str, message: str) -> None:
        raise TrainingArgumentsError(f"TrainingArguments.{name} {message}")

    def _check_types(self) -> None:
        """Types first, so later checks compare numbers with numbers (no raw TypeError from a str)."""
        for name in ("save_only_model", "load_best_model_at_end", "save_async", "pack_sequences", "do_train",
                     "do_eval", "do_predict", "logging_first_step", "eval_on_start", "prediction_loss_only",
                     "remove_unused_columns", "use_cpu", "dataloader_pin_memory", "torch_compile"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, f"must be True or False, got {getattr(self, name)!r}")
        for name in ("bf16", "fp16", "gradient_checkpointing", "activation_checkpointing", "disable_tqdm"):
            if getattr(self, name) not in (None, UNSET) and not isinstance(getattr(self, name), bool):
                self._fail(name, f"must be True or False, got {getattr(self, name)!r}")
        self.gradient_checkpointing = bool(self.gradient_checkpointing)
        self.disable_tqdm = bool(self.disable_tqdm)
        for name in ("seed", "ddp_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                self._fail(name, f"must be an int, got {value!r}")
        if self.ddp_timeout < 1:
            self._fail("ddp_timeout", f"must be >= 1 (seconds a collective may wait), got {self.ddp_timeout!r}")
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon", "adam_beta1", "adam_beta2",
                     "num_train_epochs", "warmup_steps", "logging_steps", "save_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                self._fail(name, f"must be a finite number, got {value!r}")
        resume = self.resume_from_checkpoint
        if not (resume is None or isinstance(resume, bool | str | os.PathLike)):
            self._fail("resume_from_checkpoint", f"must be None, True, False, 'auto' or a checkpoint path, got "
                       f"{resume!r}")
        if isinstance(resume, str) and resume.lower() in ("true", "false"):  # from a command line
            self.resume_from_checkpoint = resume.lower() == "true"
        if self.metric_for_best_model is not None and not isinstance(self.metric_for_best_model, str):
            self._fail("metric_for_best_model", f"must be a metric name, got {self.metric_for_best_model!r}")
        for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as err:
                    self._fail(name, f"is not valid JSON ({err}); pass a JSON object such as '{{\"min_lr\": 1e-6}}'")
            if value is not None and not isinstance(value, dict):
                self._fail(name, f"must be a dict (or a JSON object string), got {value!r}")
            setattr(self, name, value or {})

    def _check_numbers(self) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"  # Hugging Face's default
        if not isinstance(self.output_dir, str | os.PathLike) or not str(self.output_dir):
            self._fail("output_dir", f"must be a directory path, got {self.output_dir!r}")
        self.output_dir = str(self.output_dir)
        self._resolve_parallelism()
        smoothing = self.label_smoothing_factor
        if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 <= smoothing < 1:
            self._fail("label_smoothing_factor", f"must be a number in [0, 1), got {smoothing!r}")
        alpha = self.neftune_noise_alpha
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha < 0):
            self._fail("neftune_noise_alpha", f"must be None or a number >= 0, got {alpha!r}")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "cp_size", "sp_size", "tp_size", "ep_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self._fail(name, f"must be a positive int, got {value!r}")
        for name in ("logging_steps", "save_steps"):
            value = getattr(self, name)
            if value <= 0 or (value > 1 and value != int(value)):
                self._fail(name, f"must be a positive int (or a ratio of max_steps in (0, 1)), got {value!r}")
        steps = self.eval_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int | float) or steps <= 0
                                  or not math.isfinite(steps)):
            self._fail("eval_steps", f"must be None or a positive number, got {steps!r}")
        if self.warmup_steps < 0:
            self._fail("warmup_steps", f"must be >= 0 (a ratio of max_steps when below 1), got {self.warmup_steps!r}")
        if isinstance(self.dataloader_num_workers, bool) or not isinstance(self.dataloader_num_workers, int) \
                or self.dataloader_num_workers < 0:
            self._fail("dataloader_num_workers", f"must be an int >= 0, got {self.dataloader_num_workers!r}")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps == 0 \
                or self.max_steps < -1:
            self._fail("max_steps", f"must be a positive int (or -1 to use num_train_epochs), got {self.max_steps!r}")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            self._fail("num_train_epochs", f"must be > 0 when max_steps is -1, got {self.num_train_epochs!r}")
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"):
            if getattr(self, name) < 0:
                self._fail(name, f"must be a number >= 0, got {getattr(self, name)!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                self._fail(name, f"must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                self._fail(name, f"must be None or a positive int, got {value!r}")
        if self.save_total_limit is not None and (not isinstance(self.save_total_limit, int)
                                                   or self.save_total_limit < 1):
            self._fail("save_total_limit", f"must be None or an int >= 1, got {self.save_total_limit!r}")

    def _resolve_parallelism(self) -> None:
        """`parallel_sizes` from, key by key: `cp_size`/`tp_size`/`ep_size` or `parallelism_config` (the script),
        else the launcher's SHARDTRAIN_PARALLELISM; the script wins. Unset sizes are left to ParallelDims."""
        from shardtrain.config.parallelism import from_env, read_parallelism
        from shardtrain.errors import ParallelismError

        try:
            script, _ = read_parallelism(self.parallelism_config, "TrainingArguments.parallelism_config")
            launcher = from_env()
        except ParallelismError as err:
            raise TrainingArgumentsError(str(err)) from err
        for name in ("cp_size", "tp_size", "ep_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self._fail(name, f"must be a positive int, got {value!r}")
            if script.get(name, value) != value:
                self._fail(name, f"= {value} but parallelism_config.{name} = {script[name]}; set only one of them")
            script[name] = value
        self.parallel_sizes = {**launcher, **script}
        for name in ("cp_size", "tp_size", "ep_size"):
            setattr(self, name, self.parallel_sizes.get(name, 1))

    def _check_choices(self) -> None:
        self.lr_scheduler_type = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        self.optim = getattr(self.optim, "value", self.optim)
        if self.lr_scheduler_type not in SCHEDULERS:
            self._fail("lr_scheduler_type", f"got {self.lr_scheduler_type!r}; allowed values: {list(SCHEDULERS)}")
        if self.optim not in OPTIMIZERS:
            self._fail("optim", f"got {self.optim!r}; allowed values: {list(OPTIMIZERS)} (torch's elementwise "
                                "optimizers: a factored or low-bit one would see only its shard of each parameter)")
        for name, allowed in (("eval_strategy", STRATEGIES), ("logging_strategy", STRATEGIES),
                              ("save_strategy", (*STRATEGIES, "best"))):
            setattr(self, name, getattr(getattr(self, name), "value", getattr(self, name)))
            if getattr(self, name) not in allowed:
                self._fail(name, f"got {getattr(self, name)!r}; allowed values: {list(allowed)}")
        from shardtrain.errors import ChunkedLossError
        from shardtrain.train.chunked_loss import parse_setting

        try:  # off, tokens per chunk or "auto" (a command line gives text)
            self.loss_chunk_size = parse_setting(self.loss_chunk_size)
        except ChunkedLossError as err:
            raise TrainingArgumentsError(str(err)) from None
        reporters = [self.report_to] if isinstance(self.report_to, str) or self.report_to is None else \
            list(self.report_to)
        from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

        reporters = [r for r in reporters if r not in ("none", None, "jsonl")]
        if "all" in reporters:  # as Hugging Face: every installed integration
            reporters = get_available_reporting_integrations()
        unknown = [r for r in reporters if r not in INTEGRATION_TO_CALLBACK]
        if unknown:
            self._fail("report_to", f"got {unknown}; allowed values: transformers' integrations "
                       f"{list(INTEGRATION_TO_CALLBACK)}, 'all' or 'none' (metrics.jsonl in output_dir is always "
                       "written)")
        self.report_to = reporters
        if self.bf16 and self.fp16:
            self._fail("bf16", "and fp16 are both set; choose one mixed precision")
        if self.torch_compile_mode in ("reduce-overhead", "max-autotune"):
            self._fail("torch_compile_mode", f"= {self.torch_compile_mode!r} records CUDA graphs, which FSDP2's "
                       "per-step all-gather buffers and expert dispatch defeat; use 'default' or "
                       "'max-autotune-no-cudagraphs'")
        if self.torch_compile_mode not in COMPILE_MODES:
            self._fail("torch_compile_mode", f"got {self.torch_compile_mode!r}; allowed values: {list(COMPILE_MODES)}")
        if self.torch_compile_backend is not None and not isinstance(self.torch_compile_backend, str):
            self._fail("torch_compile_backend", f"must be a backend name such as 'inductor', got "
                       f"{self.torch_compile_backend!r}")
        if self.torch_compile_backend or self.torch_compile_mode:  # as Hugging Face: either one turns compile on
            self.torch_compile = True

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
        self.fsdp_config = config
        self.fsdp_enabled = enabled or env_fsdp
        if self.bf16 is UNSET and self.fp16 is UNSET:
            chosen = config.mixed_precision or os.environ.get(env.MIXED_PRECISION) or accelerate.mixed_precision
            if chosen not in (None, "", "no", "bf16", "fp16"):
                self._fail("bf16", f"/fp16 come from {env.MIXED_PRECISION}={chosen!r}, which is not no|bf16|fp16")
            self.bf16, self.fp16 = chosen == "bf16", chosen == "fp16"
        self.bf16, self.fp16 = bool(self.bf16), bool(self.fp16)

    def _check_conflicts(self) -> None:
        config: FSDPConfig = self.fsdp_config  # type: ignore[assignment]
        if self.fsdp_enabled and config.activation_checkpointing and self.gradient_checkpointing:
            self._fail("gradient_checkpointing", "and fsdp_config 'activation_checkpointing' are both set; under "
                       "FSDP use activation_checkpointing only (gradient_checkpointing re-gathers parameters)")
        if self.cp_size > 1 and self.sp_size > 1:
            self._fail("cp_size", f"= {self.cp_size} and sp_size = {self.sp_size} are both > 1; choose context "
                       "parallelism or Ulysses sequence parallelism, not both")
        if self.sp_size > 1:
            self._fail("sp_size", f"= {self.sp_size} is not supported by this version of shardtrain yet (data, "
                       "context, tensor and expert parallelism only); use cp_size for long sequences")
        for name in ("cp_size", "tp_size", "ep_size"):
            if getattr(self, name) > 1 and not self.fsdp_enabled:
                self._fail(name, f"= {getattr(self, name)} needs FSDP (the rest of the model is sharded over the "
                           "data-parallel ranks); set fsdp=True or start with shardtrain launch --fsdp")
        if self.torch_compile and self.ep_size > 1:
            self._fail("torch_compile", f"with ep_size = {self.ep_size} is not supported yet (the expert dispatch "
                       "reads token counts back every layer, which breaks compiled graphs); use one of them")
        if self.neftune_noise_alpha and (self.cp_size > 1 or self.tp_size > 1):
            self._fail("neftune_noise_alpha", "scales its noise by the sequence length and hidden size each rank "
                       "sees, which context and tensor parallelism split; use it with cp_size = tp_size = 1")
        if set(self.include_for_metrics or []) - {"inputs"}:
            self._fail("include_for_metrics", f"= {self.include_for_metrics!r}: only 'inputs' is supported; 'loss' "
                       "is each rank's micro-batch mean, which depends on how the global batch is split; drop it")
        if self.label_smoothing_factor and self.loss_chunk_size:
            self._fail("label_smoothing_factor", "is not implemented with loss_chunk_size yet; unset one of them")
        if self.cp_size > 1 and self.tp_size > 1:
            self._fail("cp_size", f"= {self.cp_size} with tp_size = {self.tp_size}: context and tensor parallelism "
                       "together are not tested yet; use one of them")
        if self.tp_plan is not None and not (isinstance(self.tp_plan, dict) and
                                             all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in self.tp_plan.items())):
            self._fail("tp_plan", f"must be a dict of module-name pattern -> style string, got {self.tp_plan!r}")
        if self.save_only_model and self.fsdp_enabled and config.state_dict_type == "SHARDED_STATE_DICT":
            self._fail("save_only_model", "cannot be used with fsdp_config 'state_dict_type': SHARDED_STATE_DICT "
                       "(a sharded checkpoint without optimizer state cannot resume); use FULL_STATE_DICT or "
                       "save_only_model=False")
        if self.save_only_model and self.load_best_model_at_end and self.fsdp_enabled:
            self._fail("save_only_model", "cannot be used with load_best_model_at_end under FSDP; drop one")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                self._fail("load_best_model_at_end", "needs eval_strategy 'steps' or 'epoch'")
            if self.save_strategy not in (self.eval_strategy, "best"):
                self._fail("load_best_model_at_end", f"needs save_strategy ({self.save_strategy!r}) to equal "
                           f"eval_strategy ({self.eval_strategy!r}) or to be 'best'")
            every = self.eval_steps or self.logging_steps
            if self.save_strategy == "steps" and self.save_steps >= 1 and every >= 1 and self.save_steps % every:
                self._fail("save_steps", "must be a multiple of eval_steps when load_best_model_at_end is set")
        if self.save_strategy == "best" and self.eval_strategy == "no":
            self._fail("save_strategy", "'best' needs an evaluation: set eval_strategy 'steps' or 'epoch'")
        if self.save_strategy == "best" and self.metric_for_best_model is None and not self.load_best_model_at_end:
            self._fail("save_strategy", "'best' needs metric_for_best_model (the metric that decides, e.g. "
                       "'eval_loss' or 'accuracy'), as in Hugging Face")
        if self.metric_for_best_model is None and self.load_best_model_at_end:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if bool(config.xla) and not self.fsdp_enabled:
            self._fail("fsdp_config", "sets 'xla' but fsdp is off; set fsdp=True")
        if self.activation_checkpointing and not self.fsdp_enabled:  # Hugging Face's meaning: the model's own
            self.gradient_checkpointing = True
            self.gradient_checkpointing_kwargs = self.gradient_checkpointing_kwargs or \
                self.activation_checkpointing_kwargs
        self.activation_checkpointing = bool(self.activation_checkpointing)

    def _check_mirrored(self) -> None:
        notes, refused = hf_compat.check_mirrored(self, IMPLEMENTED)
        if refused:
            raise TrainingArgumentsError(refused)
        if notes and self.process_index == 0:
            for note in notes:
                warnings.warn(note, stacklevel=4)


OURS, NOTES = hf_compat.OUR_FIELDS, hf_compat.FIELD_NOTES  # our fields; what the README table says of some
IMPLEMENTED = IMPLEMENTED_HF | OURS


def compatibility_markdown() -> str:
    """The README's table: every Hugging Face TrainingArguments field and ours, with what each does here."""
    return hf_compat.compatibility_table(hf_compat.compatibility_rows(IMPLEMENTED - OURS, OURS, NOTES))
