"""`TrainingArguments`: Hugging Face names and meanings, validated when constructed.

Besides what the user passes, `shardtrain launch` hands settings over through the environment
(`shardtrain.config.env`: FSDP on/off, its config, mixed precision, cp size). An argument the user passed
wins over the environment, even when its value equals the default (`fsdp=False` stays off under a launcher
that turns FSDP on): the fields given to the constructor are recorded in `explicit_fields`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardtrain.config import env
from shardtrain.config.fsdp_config import FSDPConfig, FSDPConfigError, parse_fsdp_option
from shardtrain.errors import UserError, install_error_hook

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
STRATEGIES = ("no", "steps", "epoch")
REPORTERS = ("none", "jsonl", "tensorboard")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")


class TrainingArgumentsError(UserError, ValueError):
    """An argument that cannot be used; the message names the field and the fix."""


@dataclass(kw_only=True)
class TrainingArguments:
    """Training settings (names as in `transformers.TrainingArguments` where the meaning is the same).

    After construction `fsdp_config` is an `FSDPConfig`, `fsdp_enabled` says whether FSDP2 is applied,
    and `mixed_precision` is "no", "bf16" or "fp16".
    """

    output_dir: str
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch_fused"
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    max_steps: int = -1
    num_train_epochs: float = 3.0
    max_grad_norm: float = 1.0
    bf16: bool = False
    fp16: bool = False
    seed: int = 42
    logging_steps: int = 10
    eval_strategy: str = "no"
    eval_steps: int | None = None
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    resume_from_checkpoint: str | bool | None = None
    gradient_checkpointing: bool = False
    fsdp: bool | str | list[str] = False
    fsdp_config: FSDPConfig | dict[str, Any] | str | None = None
    report_to: str | list[str] = "jsonl"
    dataloader_num_workers: int = 0
    disable_tqdm: bool = False
    cp_size: int = 1
    sp_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    ddp_timeout: int = 1800
    save_async: bool = False
    fsdp_enabled: bool = field(init=False, default=False)
    explicit_fields: ClassVar[frozenset[str]] = frozenset()  # set per instance by __init__ (below)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_numbers()
        self._check_choices()
        self._resolve_fsdp()
        self._check_conflicts()

    @property
    def mixed_precision(self) -> str:
        """"bf16", "fp16" or "no"."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def _fail(self, name: str, message: str) -> None:
        raise TrainingArgumentsError(f"TrainingArguments.{name} {message}")

    def _check_types(self) -> None:
        """Types first, so later checks compare numbers with numbers (no raw TypeError from a str)."""
        for name in ("bf16", "fp16", "gradient_checkpointing", "save_only_model", "load_best_model_at_end",
                     "disable_tqdm", "save_async"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, f"must be True or False, got {getattr(self, name)!r}")
        for name in ("seed", "ddp_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                self._fail(name, f"must be an int, got {value!r}")
        if self.ddp_timeout < 1:
            self._fail("ddp_timeout", f"must be >= 1 (seconds a collective may wait), got {self.ddp_timeout!r}")
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon", "adam_beta1", "adam_beta2",
                     "num_train_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                self._fail(name, f"must be a finite number, got {value!r}")
        resume = self.resume_from_checkpoint
        if not (resume is None or isinstance(resume, bool | str | os.PathLike)):
            self._fail("resume_from_checkpoint", f"must be None, True, False, 'auto' or a checkpoint path, got "
                       f"{resume!r}")
        if self.metric_for_best_model is not None and not isinstance(self.metric_for_best_model, str):
            self._fail("metric_for_best_model", f"must be a metric name, got {self.metric_for_best_model!r}")

    def _check_numbers(self) -> None:
        if not isinstance(self.output_dir, str | os.PathLike) or not str(self.output_dir):
            self._fail("output_dir", f"must be a directory path, got {self.output_dir!r}")
        self.output_dir = str(self.output_dir)
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "logging_steps", "save_steps", "cp_size", "sp_size", "tp_size", "ep_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self._fail(name, f"must be a positive int, got {value!r}")
        for name in ("warmup_steps", "dataloader_num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                self._fail(name, f"must be an int >= 0, got {value!r}")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps == 0 \
                or self.max_steps < -1:
            self._fail("max_steps", f"must be a positive int (or -1 to use num_train_epochs), got {self.max_steps!r}")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            self._fail("num_train_epochs", f"must be > 0 when max_steps is -1, got {self.num_train_epochs!r}")
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                self._fail(name, f"must be a number >= 0, got {value!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                self._fail(name, f"must be in [0, 1), got {getattr(self, name)!r}")
        if self.save_total_limit is not None and (not isinstance(self.save_total_limit, int)
                                                   or self.save_total_limit < 1):
            self._fail("save_total_limit", f"must be None or an int >= 1, got {self.save_total_limit!r}")
        if self.eval_steps is not None and (not isinstance(self.eval_steps, int) or self.eval_steps < 1):
            self._fail("eval_steps", f"must be None or a positive int, got {self.eval_steps!r}")

    def _check_choices(self) -> None:
        if self.lr_scheduler_type not in SCHEDULERS:
            self._fail("lr_scheduler_type", f"got {self.lr_scheduler_type!r}; allowed values: {list(SCHEDULERS)}")
        if self.optim not in OPTIMIZERS:
            self._fail("optim", f"got {self.optim!r}; allowed values: {list(OPTIMIZERS)} (torch.optim.AdamW, "
                                "fused or foreach)")
        for name in ("eval_strategy", "save_strategy"):
            if getattr(self, name) not in STRATEGIES:
                self._fail(name, f"got {getattr(self, name)!r}; allowed values: {list(STRATEGIES)}")
        reporters = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        reporters = ["none" if r in ("none", None) else r for r in reporters]
        if reporters == ["all"]:
            reporters = ["jsonl", "tensorboard"]
        unknown = [r for r in reporters if r not in REPORTERS]
        if unknown:
            self._fail("report_to", f"got unknown {unknown}; allowed values: {list(REPORTERS)} (or 'all')")
        self.report_to = [r for r in reporters if r != "none"]
        if self.bf16 and self.fp16:
            self._fail("bf16", "and fp16 are both set; choose one mixed precision")

    def _resolve_fsdp(self) -> None:
        explicit = self.explicit_fields
        try:
            env_fsdp = "fsdp" not in explicit and env.env_flag(env.USE_FSDP)
        except env.EnvError as err:
            raise TrainingArgumentsError(str(err)) from None
        try:
            enabled, overrides = parse_fsdp_option(self.fsdp)
            source = self.fsdp_config
            if source is None and os.environ.get(env.FSDP_CONFIG):
                try:
                    source = json.loads(os.environ[env.FSDP_CONFIG])
                except json.JSONDecodeError as err:
                    raise FSDPConfigError(f"environment variable {env.FSDP_CONFIG} is not valid JSON ({err}); "
                                          "unset it or let `shardtrain launch` set it") from None
            config = FSDPConfig.load(source)
            for key, value in overrides.items():
                if key == "sharding_strategy":
                    config.apply_sharding_strategy(value)
                else:
                    setattr(config, key, value)
        except FSDPConfigError as err:
            raise TrainingArgumentsError(f"TrainingArguments.fsdp_config: {err}") from None
        self.fsdp_config = config
        self.fsdp_enabled = enabled or env_fsdp
        env_mp = os.environ.get(env.MIXED_PRECISION)
        if not ({"bf16", "fp16"} & explicit or self.bf16 or self.fp16):
            chosen = config.mixed_precision or env_mp
            if chosen not in (None, "", "no", "bf16", "fp16"):
                self._fail("bf16", f"/fp16 come from {env.MIXED_PRECISION}={chosen!r}, which is not no|bf16|fp16")
            self.bf16, self.fp16 = chosen == "bf16", chosen == "fp16"
        if "cp_size" not in explicit and os.environ.get(env.CP_SIZE):
            raw = os.environ[env.CP_SIZE]
            if not raw.isdigit() or int(raw) < 1:
                self._fail("cp_size", f"comes from {env.CP_SIZE}={raw!r}, which is not an int >= 1")
            self.cp_size = int(raw)

    def _check_conflicts(self) -> None:
        config: FSDPConfig = self.fsdp_config  # type: ignore[assignment]
        if self.fsdp_enabled and config.activation_checkpointing and self.gradient_checkpointing:
            self._fail("gradient_checkpointing", "and fsdp_config 'activation_checkpointing' are both set; under "
                       "FSDP use activation_checkpointing only (gradient_checkpointing re-gathers parameters)")
        if self.cp_size > 1 and self.sp_size > 1:
            self._fail("cp_size", f"= {self.cp_size} and sp_size = {self.sp_size} are both > 1; choose context "
                       "parallelism or Ulysses sequence parallelism, not both")
        for name in ("cp_size", "sp_size", "tp_size", "ep_size"):
            if getattr(self, name) > 1:
                self._fail(name, f"= {getattr(self, name)} is not supported by this version of shardtrain yet "
                           "(data-parallel FSDP2 only); set it to 1")
        if self.save_only_model and self.fsdp_enabled and config.state_dict_type == "SHARDED_STATE_DICT":
            self._fail("save_only_model", "cannot be used with fsdp_config 'state_dict_type': SHARDED_STATE_DICT "
                       "(a sharded checkpoint without optimizer state cannot resume); use FULL_STATE_DICT or "
                       "save_only_model=False")
        if self.save_only_model and self.load_best_model_at_end and self.fsdp_enabled:
            self._fail("save_only_model", "cannot be used with load_best_model_at_end under FSDP; drop one")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                self._fail("load_best_model_at_end", "needs eval_strategy 'steps' or 'epoch'")
            if self.save_strategy != self.eval_strategy:
                self._fail("load_best_model_at_end", f"needs save_strategy ({self.save_strategy!r}) to equal "
                           f"eval_strategy ({self.eval_strategy!r})")
            if self.eval_strategy == "steps" and self.save_steps % (self.eval_steps or self.logging_steps):
                self._fail("save_steps", "must be a multiple of eval_steps when load_best_model_at_end is set")
        if self.metric_for_best_model is None and self.load_best_model_at_end:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.config_xla_without_fsdp():
            self._fail("fsdp_config", "sets 'xla' but fsdp is off; set fsdp=True")

    def config_xla_without_fsdp(self) -> bool:
        return bool(self.fsdp_config.xla) and not self.fsdp_enabled  # type: ignore[union-attr]

    @property
    def eval_every(self) -> int:
        """Steps between evaluations under eval_strategy 'steps' (HF: eval_steps, else logging_steps)."""
        return self.eval_steps or self.logging_steps


_dataclass_init = TrainingArguments.__init__


def _init_recording_explicit(self: TrainingArguments, **kwargs: Any) -> None:
    install_error_hook()  # a bad argument is one `error:` line, not a traceback
    # Remember which fields the caller gave before __post_init__ reads the environment.
    object.__setattr__(self, "explicit_fields", frozenset(kwargs))
    _dataclass_init(self, **kwargs)


_init_recording_explicit.__doc__ = _dataclass_init.__doc__
_init_recording_explicit.__signature__ = inspect.signature(_dataclass_init)  # type: ignore[attr-defined]
TrainingArguments.__init__ = _init_recording_explicit  # type: ignore[method-assign]
