"""The checks `TrainingArguments` runs when it is constructed, in order: types, numbers, choices, conflicts. Each
bad value raises one `TrainingArgumentsError` that names the field, the value and the fix; some checks also
normalise a value the way a command line gives it (a JSON string, "true"). `arguments.py` holds the fields and
resolves fsdp and the parallel sizes between these checks; the value vocabularies (schedulers, optimizers, ...)
live here and are re-exported there.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.config.values import FALSE_WORDS, TRUE_WORDS
from shardtrain.errors import TrainingArgumentsError

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
              "reduce_lr_on_plateau", "greedy")  # the last two step on the evaluation metric, as Hugging Face's
STRATEGIES = ("no", "steps", "epoch")
# torch optimizers whose update is elementwise, so a sharded parameter steps exactly as a whole one would
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "sgd", "adagrad", "rmsprop")
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")


class _Unset:
    """Default of a field that the launcher's environment may set: distinguishable from an explicit False."""

    def __repr__(self) -> str:
        return "unset"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


def check_compute_metrics(args: Any, compute_metrics: Any) -> None:
    """`batch_eval_metrics` calls `compute_metrics(EvalPrediction, compute_result)`: it must take that argument."""
    import inspect

    if args.batch_eval_metrics and compute_metrics is not None and \
            "compute_result" not in inspect.signature(compute_metrics).parameters:
        fail("batch_eval_metrics", "= True calls compute_metrics after every batch with compute_result=True on "
             "the last; give compute_metrics a compute_result argument (it returns the summary when that is True)")


def fail(name: str, message: str) -> None:
    """Raise the one error for field `name`: "TrainingArguments.<name> <message>"."""
    raise TrainingArgumentsError(f"TrainingArguments.{name} {message}")


def check_types(args: Any) -> None:
    """Types first, so later checks compare numbers with numbers (no raw TypeError from a str)."""
    for name in ("save_only_model", "load_best_model_at_end", "save_async", "pack_sequences", "do_train",
                 "do_eval", "do_predict", "logging_first_step", "eval_on_start", "prediction_loss_only",
                 "remove_unused_columns", "use_cpu", "dataloader_pin_memory", "torch_compile"):
        if not isinstance(getattr(args, name), bool):
            fail(name, f"must be True or False, got {getattr(args, name)!r}")
    for name in ("bf16", "fp16", "gradient_checkpointing", "activation_checkpointing", "disable_tqdm"):
        if getattr(args, name) not in (None, UNSET) and not isinstance(getattr(args, name), bool):
            fail(name, f"must be True or False, got {getattr(args, name)!r}")
    args.gradient_checkpointing = bool(args.gradient_checkpointing)
    args.disable_tqdm = bool(args.disable_tqdm)
    for name in ("seed", "ddp_timeout"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int):
            fail(name, f"must be an int, got {value!r}")
    if args.ddp_timeout < 1:
        fail("ddp_timeout", f"must be >= 1 (seconds a collective may wait), got {args.ddp_timeout!r}")
    for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon", "adam_beta1", "adam_beta2",
                 "num_train_epochs", "warmup_steps", "logging_steps", "save_steps"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            fail(name, f"must be a finite number, got {value!r}")
    resume = args.resume_from_checkpoint
    if not (resume is None or isinstance(resume, bool | str | os.PathLike)):
        fail("resume_from_checkpoint", f"must be None, True, False, 'auto' or a checkpoint path, got "
                   f"{resume!r}")
    if isinstance(resume, str) and resume.lower() in ("true", "false"):  # from a command line
        args.resume_from_checkpoint = resume.lower() == "true"
    if args.metric_for_best_model is not None and not isinstance(args.metric_for_best_model, str):
        fail("metric_for_best_model", f"must be a metric name, got {args.metric_for_best_model!r}")
    for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        value = getattr(args, name)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                fail(name, f"is not valid JSON ({err}); pass a JSON object such as '{{\"min_lr\": 1e-6}}'")
        if value is not None and not isinstance(value, dict):
            fail(name, f"must be a dict (or a JSON object string), got {value!r}")
        # Hugging Face's defaults: {} for the scheduler's, None for checkpointing's (a library that enables
        # checkpointing again with them, as TRL's GRPO, must get transformers' use_reentrant=False default)
        setattr(args, name, value or {} if name == "lr_scheduler_kwargs" else value)


def check_numbers(args: Any) -> None:
    if args.output_dir is None:
        args.output_dir = "trainer_output"  # Hugging Face's default
    if not isinstance(args.output_dir, str | os.PathLike) or not str(args.output_dir):
        fail("output_dir", f"must be a directory path, got {args.output_dir!r}")
    args.output_dir = str(args.output_dir)
    smoothing = args.label_smoothing_factor
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 <= smoothing < 1:
        fail("label_smoothing_factor", f"must be a number in [0, 1), got {smoothing!r}")
    alpha = args.neftune_noise_alpha
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha < 0):
        fail("neftune_noise_alpha", f"must be None or a number >= 0, got {alpha!r}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "cp_size", "sp_size", "tp_size", "ep_size"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(name, f"must be a positive int, got {value!r}")
    for name in ("logging_steps", "save_steps"):
        value = getattr(args, name)
        if value <= 0 or (value > 1 and value != int(value)):
            fail(name, f"must be a positive int (or a ratio of max_steps in (0, 1)), got {value!r}")
    steps = args.eval_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int | float) or steps <= 0
                              or not math.isfinite(steps)):
        fail("eval_steps", f"must be None or a positive number, got {steps!r}")
    if args.warmup_steps < 0:
        fail("warmup_steps", f"must be >= 0 (a ratio of max_steps when below 1), got {args.warmup_steps!r}")
    if isinstance(args.dataloader_num_workers, bool) or not isinstance(args.dataloader_num_workers, int) \
            or args.dataloader_num_workers < 0:
        fail("dataloader_num_workers", f"must be an int >= 0, got {args.dataloader_num_workers!r}")
    if isinstance(args.max_steps, bool) or not isinstance(args.max_steps, int) or args.max_steps == 0 \
            or args.max_steps < -1:
        fail("max_steps", f"must be a positive int (or -1 to use num_train_epochs), got {args.max_steps!r}")
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        fail("num_train_epochs", f"must be > 0 when max_steps is -1, got {args.num_train_epochs!r}")
    for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"):
        if getattr(args, name) < 0:
            fail(name, f"must be a number >= 0, got {getattr(args, name)!r}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            fail(name, f"must be in [0, 1), got {getattr(args, name)!r}")
    for name in ("generation_max_length", "generation_num_beams"):
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            fail(name, f"must be None or a positive int, got {value!r}")
    if args.save_total_limit is not None and (not isinstance(args.save_total_limit, int)
                                               or args.save_total_limit < 1):
        fail("save_total_limit", f"must be None or an int >= 1, got {args.save_total_limit!r}")


def check_choices(args: Any) -> None:
    args.lr_scheduler_type = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    args.optim = getattr(args.optim, "value", args.optim)
    if args.lr_scheduler_type not in SCHEDULERS:
        fail("lr_scheduler_type", f"got {args.lr_scheduler_type!r}; allowed values: {list(SCHEDULERS)}")
    if args.optim not in OPTIMIZERS:
        fail("optim", f"got {args.optim!r}; allowed values: {list(OPTIMIZERS)} (torch's elementwise "
                            "optimizers: a factored or low-bit one would see only its shard of each parameter)")
    if args.train_sampling_strategy not in ("random", "sequential"):
        fail("train_sampling_strategy", f"= {args.train_sampling_strategy!r} orders samples by length per process, "
                                        "so the global batches would depend on the layout; use 'random' or "
                                        "'sequential' (pack_sequences=True removes the padding instead)")
    for name, allowed in (("eval_strategy", STRATEGIES), ("logging_strategy", STRATEGIES),
                          ("save_strategy", (*STRATEGIES, "best"))):
        setattr(args, name, getattr(getattr(args, name), "value", getattr(args, name)))
        if getattr(args, name) not in allowed:
            fail(name, f"got {getattr(args, name)!r}; allowed values: {list(allowed)}")
    from shardtrain.errors import ChunkedLossError
    from shardtrain.train.step.chunked_loss import parse_setting

    try:  # off, tokens per chunk or "auto" (a command line gives text)
        args.loss_chunk_size = parse_setting(args.loss_chunk_size)
    except ChunkedLossError as err:
        raise TrainingArgumentsError(str(err)) from None
    args.step_guard = _step_guard_setting(args.step_guard)
    args.fault_tolerance = _fault_tolerance_setting(args.fault_tolerance)
    reporters = [args.report_to] if isinstance(args.report_to, str) or args.report_to is None else \
        list(args.report_to)
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    reporters = [r for r in reporters if r not in ("none", None, "jsonl")]
    if "all" in reporters:  # as Hugging Face: every installed integration
        reporters = get_available_reporting_integrations()
    unknown = [r for r in reporters if r not in INTEGRATION_TO_CALLBACK]
    if unknown:
        fail("report_to", f"got {unknown}; allowed values: transformers' integrations "
                   f"{list(INTEGRATION_TO_CALLBACK)}, 'all' or 'none' (metrics.jsonl in output_dir is always "
                   "written)")
    args.report_to = reporters
    if args.bf16 and args.fp16:
        fail("bf16", "and fp16 are both set; choose one mixed precision")
    if args.torch_compile_mode in ("reduce-overhead", "max-autotune"):
        fail("torch_compile_mode", f"= {args.torch_compile_mode!r} records CUDA graphs, which FSDP2's "
                   "per-step all-gather buffers and expert dispatch defeat; use 'default' or "
                   "'max-autotune-no-cudagraphs'")
    if args.torch_compile_mode not in COMPILE_MODES:
        fail("torch_compile_mode", f"got {args.torch_compile_mode!r}; allowed values: {list(COMPILE_MODES)}")
    if args.torch_compile_backend is not None and not isinstance(args.torch_compile_backend, str):
        fail("torch_compile_backend", f"must be a backend name such as 'inductor', got "
                   f"{args.torch_compile_backend!r}")
    if args.torch_compile_backend or args.torch_compile_mode:  # as Hugging Face: either one turns compile on
        args.torch_compile = True


def check_conflicts(args: Any) -> None:
    config: FSDPConfig = args.fsdp_config  # type: ignore[assignment]
    if args.bf16 and not args.use_cpu and not config.xla and not _cpu_chosen():
        import torch

        if not torch.cuda.is_available():  # transformers refuses it, and TRL's configs turn bf16 on by default
            fail("bf16", "= True but no GPU is visible here and the run was not asked to train on CPU; set "
                         "use_cpu=True (or `shardtrain launch --cpu`) to train on CPU in bf16, or bf16=False")
    if args.fsdp_enabled and config.activation_checkpointing and args.gradient_checkpointing:
        fail("gradient_checkpointing", "and fsdp_config 'activation_checkpointing' are both set; under "
                   "FSDP use activation_checkpointing only (gradient_checkpointing re-gathers parameters)")
    if args.cp_size > 1 and args.sp_size > 1:
        fail("cp_size", f"= {args.cp_size} and sp_size = {args.sp_size} are both > 1; choose context "
                   "parallelism or Ulysses sequence parallelism, not both")
    if args.sp_size > 1:
        fail("sp_size", f"= {args.sp_size} is not supported by this version of shardtrain yet (data, "
                   "context, tensor and expert parallelism only); use cp_size for long sequences")
    for name in ("cp_size", "tp_size", "ep_size"):
        if getattr(args, name) > 1 and not args.fsdp_enabled:
            fail(name, f"= {getattr(args, name)} needs FSDP (the rest of the model is sharded over the "
                       "data-parallel ranks); set fsdp=True or start with shardtrain launch --fsdp")
    if args.torch_compile and args.ep_size > 1:
        fail("torch_compile", f"with ep_size = {args.ep_size} is not supported yet (the expert dispatch "
                   "reads token counts back every layer, which breaks compiled graphs); use one of them")
    if args.neftune_noise_alpha and (args.cp_size > 1 or args.tp_size > 1):
        fail("neftune_noise_alpha", "scales its noise by the sequence length and hidden size each rank "
                   "sees, which context and tensor parallelism split; use it with cp_size = tp_size = 1")
    if set(args.include_for_metrics or []) - {"inputs"}:
        fail("include_for_metrics", f"= {args.include_for_metrics!r}: only 'inputs' is supported; 'loss' "
                   "is each rank's micro-batch mean, which depends on how the global batch is split; drop it")
    if args.label_smoothing_factor and args.loss_chunk_size:
        fail("label_smoothing_factor", "is not implemented with loss_chunk_size yet; unset one of them")
    if args.cp_size > 1 and args.tp_size > 1:
        fail("cp_size", f"= {args.cp_size} with tp_size = {args.tp_size}: context and tensor parallelism "
                   "together are not tested yet; use one of them")
    if args.tp_plan is not None and not (isinstance(args.tp_plan, dict) and
                                         all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in args.tp_plan.items())):
        fail("tp_plan", f"must be a dict of module-name pattern -> style string, got {args.tp_plan!r}")
    if args.save_only_model and args.fsdp_enabled and config.state_dict_type == "SHARDED_STATE_DICT":
        fail("save_only_model", "cannot be used with fsdp_config 'state_dict_type': SHARDED_STATE_DICT "
                   "(a sharded checkpoint without optimizer state cannot resume); use FULL_STATE_DICT or "
                   "save_only_model=False")
    if args.save_only_model and args.load_best_model_at_end and args.fsdp_enabled:
        fail("save_only_model", "cannot be used with load_best_model_at_end under FSDP; drop one")
    if args.load_best_model_at_end:
        if args.eval_strategy == "no":
            fail("load_best_model_at_end", "needs eval_strategy 'steps' or 'epoch'")
        if args.save_strategy not in (args.eval_strategy, "best"):
            fail("load_best_model_at_end", f"needs save_strategy ({args.save_strategy!r}) to equal "
                       f"eval_strategy ({args.eval_strategy!r}) or to be 'best'")
        every = args.eval_steps or args.logging_steps
        if args.save_strategy == "steps" and args.save_steps >= 1 and every >= 1 and args.save_steps % every:
            fail("save_steps", "must be a multiple of eval_steps when load_best_model_at_end is set")
    if args.save_strategy == "best" and args.eval_strategy == "no":
        fail("save_strategy", "'best' needs an evaluation: set eval_strategy 'steps' or 'epoch'")
    if args.save_strategy == "best" and args.metric_for_best_model is None and not args.load_best_model_at_end:
        fail("save_strategy", "'best' needs metric_for_best_model (the metric that decides, e.g. 'eval_loss' or "
                   "'accuracy'), as in Hugging Face: `args.metric_for_best_model` must be provided when using "
                   "'best' save_strategy")
    if args.metric_for_best_model is None and args.load_best_model_at_end:
        args.metric_for_best_model = "loss"
    if args.greater_is_better is None and args.metric_for_best_model is not None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")
    if bool(config.xla) and not args.fsdp_enabled:
        fail("fsdp_config", "sets 'xla' but fsdp is off; set fsdp=True")
    if args.activation_checkpointing and not args.fsdp_enabled:  # Hugging Face's meaning: the model's own
        args.gradient_checkpointing = True
        args.gradient_checkpointing_kwargs = args.gradient_checkpointing_kwargs or \
            args.activation_checkpointing_kwargs
    args.activation_checkpointing = bool(args.activation_checkpointing)


def _step_guard_setting(value: Any) -> bool | dict | None:
    """`step_guard` as true/false or a dict (a command line gives text: a true/false word or JSON), checked."""
    from shardtrain.train.step.guard import StepGuardConfig

    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            value = word in TRUE_WORDS
        else:
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise TrainingArgumentsError(f"TrainingArguments.step_guard got {value!r}; use true, or JSON such as "
                                             "'{\"spike_factor\": 10}'") from None
    StepGuardConfig.from_setting(value)
    return value


def _fault_tolerance_setting(value: Any) -> dict | None:
    """`fault_tolerance` as a dict (a command line gives JSON), checked with the launcher's variables."""
    from shardtrain.config.fault_tolerance import FaultTolerance

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise TrainingArgumentsError("TrainingArguments.fault_tolerance takes a dict (JSON on a command line), "
                                         "such as '{\"replica_group\": 0, \"replica_groups\": 2, "
                                         "\"lighthouse\": \"http://host:29510\"}'")
    FaultTolerance.resolve(value)
    return value


def _cpu_chosen() -> bool:
    """Whether the launcher chose CPU processes (`shardtrain launch --cpu` / use_cpu: true)."""
    from shardtrain.config import env

    return env.env_flag(env.CPU)
