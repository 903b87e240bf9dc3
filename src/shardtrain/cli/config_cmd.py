"""`shardtrain config`: a few questions -> `$SHARDTRAIN_HOME/default_config.yaml` (~/.cache/shardtrain).

    shardtrain config                                   # interactive; Enter keeps the value in [brackets]
    shardtrain config --default                         # no questions: built-in defaults (+ flags below)
    shardtrain config --num_processes 4 --mixed_precision bf16   # flags answer those, the rest is asked
    printf '\\n\\n\\n2\\nbf16\\n' | shardtrain config       # answers from stdin, one line each (EOF = Enter)
    shardtrain config --config_file my.yaml             # write somewhere else

Re-running shows the current file's values as defaults. At a terminal a bad answer is asked again; from
a pipe or a flag it is an error (exit 2). The file uses Accelerate's YAML keys (see launch_config.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtrain.config.fsdp_config import MIXED_PRECISIONS, STATE_DICT_TYPES, WRAP_POLICIES, FSDPConfig
from shardtrain.config.launch_config import (
    DEFAULT_MULTI_NODE_PORT,
    RDZV_BACKENDS,
    LaunchConfig,
    default_config_path,
    load_launch_config,
    write_launch_config,
)
from shardtrain.config.values import as_bool, as_int
from shardtrain.errors import LaunchConfigError

Answers = dict[str, Any]


def check_parallel_sizes(**sizes: object) -> object:
    """`ParallelDims.resolve`, imported when a config has parallelism sizes (it imports torch)."""
    from shardtrain.parallel.dims import ParallelDims

    return ParallelDims.resolve(**sizes)


def _choice(*options: str) -> Callable[[str, Answers], str]:
    def parse(text: str, answers: Answers) -> str:
        for option in options:
            if text.lower() == option.lower():
                return option
        raise ValueError(f"choose one of {', '.join(options)}")

    return parse


def _yes_no(text: str, answers: Answers) -> bool:
    try:
        return as_bool("answer", text, ValueError)
    except ValueError:
        raise ValueError("answer yes or no") from None


def _activation_checkpointing(text: str, answers: Answers) -> bool | str:
    """yes / full (recompute each unit), selective (per op), or no."""
    if text.strip().lower() == "selective":
        return "selective"
    try:
        return as_bool("answer", "true" if text.strip().lower() == "full" else text, ValueError)
    except ValueError:
        raise ValueError("answer yes (full), selective or no") from None


def _int(
    minimum: int, maximum: Callable[[Answers], int | None] = lambda a: None
) -> Callable[[str, Answers], int]:
    def parse(text: str, answers: Answers) -> int:
        top = maximum(answers)
        fix = f"enter a whole number from {minimum}" + (f" to {top}" if top is not None else " up")
        try:
            number = as_int("answer", text, minimum, fix, ValueError)
        except ValueError:
            raise ValueError(fix) from None
        if top is not None and number > top:
            raise ValueError(fix)
        return number

    return parse


def _num_processes(text: str, answers: Answers) -> int:
    value = _int(1)(text, answers)
    if value % answers["num_machines"]:
        raise ValueError(f"the total must be divisible by the {answers['num_machines']} machines")
    return value


def _address(text: str, answers: Answers) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("enter the IP address or host name of the machine with machine_rank 0")
    return text


def _classes(text: str, answers: Answers) -> list[str]:
    if text.lower() in ("none", "-"):
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise ValueError(f"{bad} are not class names; enter names like LlamaDecoderLayer, comma-separated")
    return names


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(value)
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Question:
    """One question; `key` is also the name of its flag (`--key`)."""

    key: str
    prompt: str
    parse: Callable[[str, Answers], Any]
    ask_if: Callable[[Answers], bool] = lambda answers: True


def _multi(a: Answers) -> bool:
    return a["num_machines"] > 1


def _fsdp(a: Answers) -> bool:
    return a["fsdp"]


_YN = " (yes/no)"
_TRANSFORMER = lambda a: a["fsdp"] and a["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"  # noqa: E731
_SIZE = lambda a: a["fsdp"] and a["auto_wrap_policy"] == "SIZE_BASED_WRAP"  # noqa: E731
QUESTIONS = (
    Question("compute_environment", "Compute environment (LOCAL_MACHINE)", _choice("LOCAL_MACHINE")),
    Question("use_cpu", "Train on CPU only, even if GPUs are visible?" + _YN, _yes_no),
    Question("num_machines", "How many machines?", _int(1)),
    Question("machine_rank", "Rank of this machine (0 = main)?", _int(0, lambda a: a["num_machines"] - 1),
             _multi),
    Question("main_process_ip", "IP address of the main machine (rank 0)?", _address, _multi),
    Question("main_process_port", "Port on the main machine?", _int(1, lambda a: 65535), _multi),
    Question("rdzv_backend", f"Rendezvous backend ({'/'.join(RDZV_BACKENDS)})", _choice(*RDZV_BACKENDS),
             _multi),
    Question("num_processes", "How many processes in total (all machines)?", _num_processes),
    Question("mixed_precision", f"Mixed precision ({'/'.join(MIXED_PRECISIONS)})",
             _choice(*MIXED_PRECISIONS)),
    Question("fsdp", "Use FSDP (shard parameters, gradients, optimizer state)?" + _YN, _yes_no),
    Question("reshard_after_forward", "Reshard parameters after forward (less memory)?" + _YN, _yes_no,
             _fsdp),
    Question("cpu_offload", "Offload parameters, gradients, optimizer state to CPU?" + _YN, _yes_no, _fsdp),
    Question("auto_wrap_policy", f"Wrap policy ({'/'.join(WRAP_POLICIES)})", _choice(*WRAP_POLICIES), _fsdp),
    Question("transformer_layer_cls_to_wrap", "Layer classes to wrap, comma-separated (empty: the model's "
             "_no_split_modules; 'none' clears)", _classes, _TRANSFORMER),
    Question("min_num_params", "Minimum parameters per wrapped module?", _int(0), _SIZE),
    Question("state_dict_type", f"Checkpoint type ({'/'.join(STATE_DICT_TYPES)})", _choice(*STATE_DICT_TYPES),
             _fsdp),
    Question("cpu_ram_efficient_loading", "Build the model on the meta device and have each rank read only its "
             "shards of the weights (host memory: one shard per rank)?" + _YN, _yes_no, _fsdp),
    Question("activation_checkpointing", "Activation checkpointing (recompute in backward)? (yes = full / "
             "selective = keep matmul and attention outputs / no)", _activation_checkpointing, _fsdp),
)
# `shardtrain launch`'s names (Accelerate's) for the same settings: `config` takes them too
LAUNCH_NAMES = {"use_cpu": "cpu", "fsdp": "use_fsdp", "reshard_after_forward": "fsdp_reshard_after_forward",
                "cpu_offload": "fsdp_offload_params", "auto_wrap_policy": "fsdp_auto_wrap_policy",
                "transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
                "min_num_params": "fsdp_min_num_params", "state_dict_type": "fsdp_state_dict_type",
                "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
                "activation_checkpointing": "fsdp_activation_checkpointing"}
_FSDP_KEYS = ("reshard_after_forward", "cpu_offload", "auto_wrap_policy", "transformer_layer_cls_to_wrap",
              "min_num_params", "state_dict_type", "cpu_ram_efficient_loading", "activation_checkpointing")


def answers_from_config(config: LaunchConfig) -> Answers:
    """The answers that reproduce `config` (used as defaults on a re-run)."""
    fsdp = FSDPConfig.load(config.fsdp_config)
    answers = {key: getattr(config, key) for key in ("compute_environment", "use_cpu", "num_machines",
                                                      "machine_rank", "main_process_ip", "num_processes",
                                                      "mixed_precision")}
    answers |= {key: getattr(fsdp, key) for key in _FSDP_KEYS}
    answers.update(main_process_port=config.main_process_port or DEFAULT_MULTI_NODE_PORT,
                   fsdp=config.use_fsdp, rdzv_backend=config.rdzv_backend or "c10d",
                   reshard_after_forward=bool(fsdp.reshard_after_forward))
    return answers


def factory_defaults() -> Answers:
    """Built-in answers: one machine, one process per GPU (or 1 on CPU), no mixed precision, FSDP on."""
    import torch

    answers = answers_from_config(LaunchConfig())
    answers["num_processes"] = max(1, torch.cuda.device_count())
    return answers


def config_from_answers(answers: Answers, base: LaunchConfig | None = None) -> LaunchConfig:
    """Build the LaunchConfig to write (keeps max_restarts / parallelism settings of `base`)."""
    import torch

    multi, gpu = answers["num_machines"] > 1, torch.cuda.is_available() and not answers["use_cpu"]
    plain = "NO" if answers["num_processes"] == 1 else ("MULTI_GPU" if gpu else "MULTI_CPU")
    config = LaunchConfig(
        compute_environment=answers["compute_environment"],
        distributed_type="FSDP" if answers["fsdp"] else plain,
        mixed_precision=answers["mixed_precision"], use_cpu=answers["use_cpu"],
        num_processes=answers["num_processes"], num_machines=answers["num_machines"],
        machine_rank=answers["machine_rank"] if multi else 0,
        main_process_ip=answers["main_process_ip"] if multi else None,
        main_process_port=answers["main_process_port"] if multi else None,
        rdzv_backend=answers["rdzv_backend"] if multi else None)
    if answers["fsdp"]:
        policy = answers["auto_wrap_policy"]
        unused = {"min_num_params", "transformer_layer_cls_to_wrap"}
        unused -= {"transformer_layer_cls_to_wrap" if policy == "TRANSFORMER_BASED_WRAP" else
                   "min_num_params" if policy == "SIZE_BASED_WRAP" else ""}
        config.fsdp_config = {"version": 2, **{key: answers[key] for key in _FSDP_KEYS if key not in unused}}
    if base is not None:
        config.max_restarts = base.max_restarts
        config.use_parallelism_config, config.parallelism = base.use_parallelism_config, dict(base.parallelism)
    return config


def _default_for(question: Question, defaults: Answers, answers: Answers) -> Any:
    value = defaults[question.key]
    if question.key == "num_processes" and value % answers["num_machines"]:
        value = answers["num_machines"] * max(1, value // answers["num_machines"])
    if question.key == "machine_rank" and value >= answers["num_machines"]:
        value = 0
    return value


def ask_questions(defaults: Answers, preset: dict[str, str], ask: bool) -> Answers:
    """Answer each question that applies: from `preset` (flags), else `input()` (the default if not `ask`).

    Raises:
        LaunchConfigError: a bad flag value, or a bad answer read from a non-terminal stdin.
    """
    interactive, eof = sys.stdin is not None and sys.stdin.isatty(), False
    answers: Answers = {}
    for q in QUESTIONS:
        if not q.ask_if(answers):
            if q.key in preset:
                print(f"warning: --{q.key} is ignored with these answers", file=sys.stderr)
            answers[q.key] = defaults[q.key]
            continue
        default = _default_for(q, defaults, answers)
        if q.key in preset:
            try:
                answers[q.key] = q.parse(preset[q.key].strip(), answers)
            except ValueError as err:
                raise LaunchConfigError(f"--{q.key} {preset[q.key]!r}: {err}") from None
            continue
        while True:
            text = ""
            if ask and not eof:
                try:
                    text = input(f"{q.prompt} [{_show(default)}]: ").strip()
                    if not interactive:
                        print(text)  # echo piped answers so the transcript reads like a session
                except EOFError:
                    eof = True
                    print()
            elif ask:  # stdin has ended: show the question and keep its default, as Enter would
                print(f"{q.prompt} [{_show(default)}]: ")
            try:
                answers[q.key] = q.parse(text or _show(default), answers)
                break
            except ValueError as err:
                if not (ask and interactive and not eof):
                    what = f"answer {text!r}" if text else f"the default {_show(default)!r}"
                    raise LaunchConfigError(f"{what} to '{q.prompt}' ({q.key}): {err}; answer it or pass "
                                            f"--{q.key}") from None
                print(f"  {err}; please answer again.")
    return answers


def add_config_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `config`, one flag per question."""
    p = subparsers.add_parser(
        "config",
        help="write the default launch config (interactive or with flags)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--default", action="store_true", help="ask nothing: built-in defaults plus the given flags"
    )
    p.add_argument("--config_file", help="where to write (default: $SHARDTRAIN_HOME/default_config.yaml)")
    for q in QUESTIONS:
        names = [f"--{q.key}"] + ([f"--{LAUNCH_NAMES[q.key]}"] if q.key in LAUNCH_NAMES else [])
        yes_no = q.parse is _yes_no  # `--cpu` alone means yes, as on `shardtrain launch`
        p.add_argument(*names, dest=f"answer_{q.key}", metavar="VALUE", help=q.prompt.replace("%", "%%"),
                       **({"nargs": "?", "const": "yes"} if yes_no else {}))
    p.set_defaults(func=run_config)


def run_config(args: argparse.Namespace) -> int:
    """Entry of `shardtrain config`."""
    path = args.config_file or default_config_path()
    base: LaunchConfig | None = None
    defaults = factory_defaults()
    if not args.default:
        try:
            base, source = load_launch_config(path) if Path(path).is_file() else (None, None)
            if base is not None:
                defaults.update(answers_from_config(base))
                print(f"Current values from {source} are shown in [brackets]; press Enter to keep them.")
        except ValueError as err:
            print(
                f"warning: ignoring the current config ({err}); built-in defaults are shown", file=sys.stderr
            )
    preset = {
        q.key: getattr(args, f"answer_{q.key}")
        for q in QUESTIONS
        if getattr(args, f"answer_{q.key}") is not None
    }
    answers = ask_questions(defaults, preset, ask=not args.default)
    config = config_from_answers(answers, base)
    config.validate(str(path), check_sizes=check_parallel_sizes)
    written = write_launch_config(config, path)
    print(f"Wrote {written}")
    return 0
