"""Accelerate's launch settings, read as shardtrain's: its FSDP flags and the variables `accelerate launch` writes.

    accelerate launch --use_fsdp --fsdp_version 2 --mixed_precision bf16 --fsdp_offload_params true train.py
    shardtrain launch --use_fsdp --fsdp_offload_params true --fsdp_activation_checkpointing true train.py

One table (`FSDP_FLAGS`: flag -> the variable Accelerate's launcher writes for it) serves both: `shardtrain
launch` accepts the flags, and `TrainingArguments` reads the variables when the script was started by
`accelerate launch` (shardtrain's own SHARDTRAIN_* variables win when both are set; arguments the script passes
win over both). Each setting is honoured as an Accelerate config file would honour it, or refused with the flag
named: FSDP version 1 (shardtrain runs FSDP2), DeepSpeed, Megatron-LM, fp8, a dynamo backend (use
`torch_compile`). FSDP1-only settings with no FSDP2 meaning are reported as ignored when they differ from
Accelerate's defaults. `PREFIXES` are hidden from the Accelerator shardtrain builds for libraries
(`parallel/accelerate_bridge.py`), so it sets up no FSDP plugin or autocast of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardtrain.errors import LaunchConfigError

PREFIXES = ("ACCELERATE_", "FSDP_")

USE_FSDP = "ACCELERATE_USE_FSDP"
MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
USE_CPU = "ACCELERATE_USE_CPU"

# Accelerate's "FSDP Arguments" (accelerate launch --help) -> the variable its launcher writes; a unit test keeps
# this equal to the installed Accelerate's parser
FSDP_FLAGS: dict[str, str] = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS",
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "fsdp_forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "fsdp_use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_activation_checkpointing_offload": "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
}
# What Accelerate's launcher writes for a flag not given; FSDP1-only settings at these values are not reported
ACCELERATE_DEFAULTS = {"fsdp_use_orig_params": "true", "fsdp_sync_module_states": "true",
                       "fsdp_activation_checkpointing_offload": "false"}
# FSDP1's settings that FSDP2 has no use for (Accelerate's FSDP2 plugin ignores them too). fsdp_forward_prefetch is
# not one: shardtrain gives it its FSDP1 meaning with FSDP2's explicit prefetch (FSDPConfig.forward_prefetch).
FSDP1_ONLY = ("fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states")


def flag_help(flag: str) -> str:
    """`shardtrain launch --help`'s line for Accelerate's FSDP flag `flag`: what is honoured, what is not."""
    if flag in FSDP1_ONLY:
        return f"accelerate launch --{flag}: FSDP1 only, ignored (a warning names it when not Accelerate's default)"
    special = {
        "fsdp_version": "accelerate launch --fsdp_version: 2 (1, also Accelerate's default with --use_fsdp, is "
                        "refused: FSDP2 only)",
        "fsdp_sharding_strategy": "accelerate launch --fsdp_sharding_strategy: FSDP1's, ignored (FSDP2 reads "
                                  "--fsdp_reshard_after_forward)",
        "fsdp_activation_checkpointing_offload": "accelerate launch --fsdp_activation_checkpointing_offload: "
                                                 "false only (true is refused)",
    }
    return special.get(flag, f"as accelerate launch --{flag} (honoured)")


@dataclass(frozen=True)
class AccelerateSettings:
    """What an Accelerate launch asked for, in shardtrain's terms (`fsdp` in `FSDPConfig` key space)."""

    use_fsdp: bool = False
    fsdp: dict[str, Any] = field(default_factory=dict)
    mixed_precision: str | None = None
    use_cpu: bool = False
    ignored: tuple[str, ...] = ()


def _true(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def fsdp_from_flags(values: Mapping[str, Any], how: str = "--{}",
                    default_version: str = "2") -> tuple[dict[str, Any], list[str]]:
    """Accelerate FSDP flag values (`FSDP_FLAGS` names) -> (`FSDPConfig` settings, ignored flags as written).

    Raises:
        LaunchConfigError: `fsdp_version` 1, or `fsdp_activation_checkpointing_offload` on.
    """
    settings: dict[str, Any] = {}
    ignored: list[str] = []
    version = str(values.get("fsdp_version") or default_version).strip()
    if version != "2":
        unset = " (it writes 1 when the flag is not given)" if default_version == "1" else ""
        raise LaunchConfigError(f"{how.format('fsdp_version')} = {version}{unset}: shardtrain runs FSDP2 only; "
                                f"pass {how.format('fsdp_version')} 2")
    for flag, value in values.items():
        if value is None or flag == "fsdp_version":
            continue
        text = str(value).strip()
        if flag in FSDP1_ONLY:
            if text.lower() != ACCELERATE_DEFAULTS.get(flag, ""):
                ignored.append(f"{how.format(flag)} {text} (FSDP1 only; FSDP2 prefetches in backward and keeps "
                               "original parameters by design)")
        elif flag == "fsdp_activation_checkpointing_offload":
            if _true(text):
                raise LaunchConfigError(f"{how.format(flag)} {text}: offloading checkpointed activations is not "
                                        f"supported; drop it (keep {how.format('fsdp_activation_checkpointing')})")
        elif flag == "fsdp_sharding_strategy":
            continue  # FSDP1's; under FSDP2 Accelerate reads fsdp_reshard_after_forward instead
        elif flag == "fsdp_transformer_layer_cls_to_wrap":
            settings["transformer_layer_cls_to_wrap"] = [c.strip() for c in text.split(",") if c.strip()]
        else:
            settings[flag.removeprefix("fsdp_")] = text
    settings["version"] = 2
    return settings, ignored


def from_environment(environ: Mapping[str, str]) -> AccelerateSettings:
    """The settings `accelerate launch` handed this process (all defaults when it did not start it).

    Raises:
        LaunchConfigError: a setting shardtrain cannot honour, naming `accelerate launch`'s flag and the fix.
    """
    refused = {"ACCELERATE_USE_DEEPSPEED": "--use_deepspeed: shardtrain shards with FSDP2; use --use_fsdp",
               "ACCELERATE_USE_MEGATRON_LM": "--use_megatron_lm: use shardtrain's tp_size / parallelism_config"}
    for name, message in refused.items():
        if _true(environ.get(name)):
            raise LaunchConfigError(f"accelerate launch {message}")
    dynamo = environ.get("ACCELERATE_DYNAMO_BACKEND", "no").strip()
    if dynamo.lower() not in ("", "no"):
        raise LaunchConfigError(f"accelerate launch --dynamo_backend {dynamo}: compile through the script's "
                                f"TrainingArguments(torch_compile=True, torch_compile_backend={dynamo.lower()!r}), "
                                "which compiles each FSDP unit before sharding")
    precision = environ.get(MIXED_PRECISION)
    if precision is not None and precision not in ("no", "bf16", "fp16"):
        raise LaunchConfigError(f"accelerate launch --mixed_precision {precision}: shardtrain offers no, bf16 "
                                "and fp16")
    use_fsdp = _true(environ.get(USE_FSDP))
    fsdp: dict[str, Any] = {}
    ignored: list[str] = []
    if use_fsdp:
        values = {flag: environ.get(name) for flag, name in FSDP_FLAGS.items()}
        fsdp, ignored = fsdp_from_flags(values, how="accelerate launch --{}", default_version="1")
    return AccelerateSettings(use_fsdp=use_fsdp, fsdp=fsdp, mixed_precision=precision,
                              use_cpu=_true(environ.get(USE_CPU)), ignored=tuple(ignored))
