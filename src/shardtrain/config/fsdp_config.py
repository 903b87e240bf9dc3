"""`fsdp_config`: the user's FSDP2 settings, parsed and validated once.

Accepts what Hugging Face Trainer + Accelerate accept (a dict or a JSON file; `fsdp_`-prefixed keys;
legacy sharding strategies as strings or Accelerate's integers 1-5) and turns it into one typed
`FSDPConfig`. Every error names the key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtrain.config.values import as_bytes
from shardtrain.errors import FSDPConfigError

WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
# `activation_checkpointing` values: what each spelling means (stored as False / True / "selective", so that
# `if config.activation_checkpointing:` keeps meaning "some checkpointing" everywhere)
AC_MODES = ("none", "full", "selective")
_AC_SPELLINGS: dict[str, bool | str] = {"false": False, "none": False, "no": False, "true": True, "full": True,
                                        "yes": True, "selective": "selective"}

# Legacy strategy -> (reshard_after_forward, replicate_only, hybrid). Names and Accelerate's integers.
SHARDING_STRATEGIES: dict[str, tuple[bool, bool, bool]] = {
    "full_shard": (True, False, False),
    "shard_grad_op": (False, False, False),
    "no_shard": (False, True, False),
    "hybrid_shard": (True, False, True),
    "hybrid_shard_zero2": (False, False, True),
}
_STRATEGY_BY_NUMBER = {1: "full_shard", 2: "shard_grad_op", 3: "no_shard", 4: "hybrid_shard", 5: "hybrid_shard_zero2"}

# Accelerate spellings that mean one of our keys.
_ALIASES = {"offload_params": "cpu_offload", "min_num_param": "min_num_params", "wrap_policy": "auto_wrap_policy"}
# FSDP1-only knobs that FSDP2 has no use for: accepted so old configs load, ignored with a warning.
IGNORED_FSDP1_KEYS = frozenset(
    {"backward_prefetch", "backward_prefetch_policy", "sync_module_states",
     "use_orig_params", "limit_all_gathers", "activation_cpu_offload", "cpu_offload_pin_memory"}
)


def _normalize_strategy(value: Any) -> str:
    if isinstance(value, bool):
        raise FSDPConfigError(f"fsdp_config key 'sharding_strategy' got {value!r}; use one of "
                              f"{sorted(SHARDING_STRATEGIES)} or 1-5")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        number = int(value)
        if number not in _STRATEGY_BY_NUMBER:
            raise FSDPConfigError(f"fsdp_config key 'sharding_strategy' got {value!r}; Accelerate's numbers are "
                                  f"1 (full_shard) .. 5 (hybrid_shard_zero2)")
        return _STRATEGY_BY_NUMBER[number]
    if isinstance(value, str):
        name = value.strip().lower().replace(" ", "_").replace("-", "_")
        if name in SHARDING_STRATEGIES:
            return name
    raise FSDPConfigError(f"fsdp_config key 'sharding_strategy' got {value!r}; allowed values: "
                          f"{sorted(SHARDING_STRATEGIES)} or 1-5")


def parse_activation_checkpointing(value: Any) -> bool | str:
    """The `activation_checkpointing` key: False (none), True (full: recompute each unit) or "selective".

    Accepts booleans and the strings "false"/"none", "true"/"full", "selective" (any case).

    Raises:
        FSDPConfigError: any other value (names the key, the value and the allowed ones).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _AC_SPELLINGS:
        return _AC_SPELLINGS[value.strip().lower()]
    per_layer = (" (checkpointing every Nth layer is not supported: use \"selective\" or true)"
                 if isinstance(value, int) else "")
    raise FSDPConfigError(f"fsdp_config key 'activation_checkpointing' got {value!r}{per_layer}; expected true or "
                          f"\"full\" (recompute each FSDP unit in backward), \"selective\" (save matmul and "
                          f"attention outputs, recompute the rest) or false / \"none\"")


def parse_fsdp_option(fsdp: bool | str | list[str] | None) -> tuple[bool, dict[str, Any]]:
    """Read `TrainingArguments.fsdp` (`True`, or legacy strings like "full_shard auto_wrap").

    Returns:
        (enabled, config overrides implied by the strings).
    """
    if fsdp is None or fsdp is False or fsdp == "" or fsdp == []:
        return False, {}
    if fsdp is True:
        return True, {}
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp)
    words = [w.strip().lower() for w in words]
    if words and all(w in ("false", "0", "no", "off") for w in words):  # "--fsdp false" on a command line
        return False, {}
    # "full shard" (two words, as `accelerate launch --fsdp="full shard"`) means full_shard.
    joined = "_".join(words)
    if joined in SHARDING_STRATEGIES:
        return True, {"sharding_strategy": joined}
    overrides: dict[str, Any] = {}
    for word in words:
        if word in SHARDING_STRATEGIES:
            overrides["sharding_strategy"] = word
        elif word == "offload":
            overrides["cpu_offload"] = True
        elif word == "auto_wrap":
            overrides.setdefault("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
        elif word in ("true", "1", "yes"):
            continue
        else:
            raise FSDPConfigError(f"TrainingArguments.fsdp got unknown option {word!r}; use True or any of "
                                  f"{sorted(SHARDING_STRATEGIES) + ['offload', 'auto_wrap']}")
    return True, overrides


@dataclass(kw_only=True)
class FSDPConfig:
    """Typed FSDP2 settings. Build with `FSDPConfig.load(dict | path | FSDPConfig)`.

    Attributes mirror the `fsdp_config` keys of Hugging Face Trainer (FSDP2). Derived from a legacy
    `sharding_strategy`: `replicate_only` (no_shard) and `hybrid` (2-D mesh: replicate x shard).
    `activation_checkpointing` is False, True (full) or "selective" (per-op; see `ac_mode`). `forward_prefetch`
    (FSDP1's name, FSDP2's explicit prefetch): each unit starts the all-gather of the next one before its own
    forward, and of the previous one before its own backward. `layout: "auto"`: the planner chooses the sharding,
    activation checkpointing and loss chunk the user did not set (`given` holds the keys the user did set), the
    fastest predicted that fits `max_memory_per_rank` (`shardtrain.plan.auto_layout`).
    """

    version: int = 2
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    transformer_layer_cls_to_wrap: list[str] = field(default_factory=list)
    min_num_params: int = 100_000_000
    state_dict_type: str = "FULL_STATE_DICT"
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool | str = False
    output_unit: bool | str = "auto"
    forward_prefetch: bool = False
    mixed_precision: str | None = None
    sharding_strategy: str | None = None
    replicate_only: bool = False
    hybrid: bool = False
    dp_shard_size: int | None = None
    xla: bool = False
    xla_fsdp_settings: dict[str, Any] = field(default_factory=dict)
    xla_fsdp_grad_ckpt: bool = False
    xla_fsdp_v2: bool = False
    layout: str | None = None
    max_memory_per_rank: int | None = None
    given: frozenset[str] = field(default_factory=frozenset, repr=False, compare=False)

    @classmethod
    def load(cls, source: FSDPConfig | dict[str, Any] | str | os.PathLike | None) -> FSDPConfig:
        """Parse a dict, a JSON file path, a JSON object as text (what Hugging Face accepts on the command line,
        e.g. `--fsdp_config '{"xla": true}'`), or return a copy of an `FSDPConfig`.

        Raises:
            FSDPConfigError: unknown key (with the closest valid one), wrong type or value, or contradiction.
        """
        if source is None:
            return cls()
        if isinstance(source, FSDPConfig):
            return dataclasses.replace(source)
        if isinstance(source, str) and source.lstrip().startswith("{"):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as err:
                raise FSDPConfigError(f"fsdp_config {source!r} is not valid JSON: {err}") from err
        if isinstance(source, str | os.PathLike):
            path = Path(source)
            if not path.is_file():
                raise FSDPConfigError(f"fsdp_config file {str(path)!r} does not exist; pass a dict or the path "
                                      f"of a JSON file")
            try:
                source = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise FSDPConfigError(f"fsdp_config file {str(path)!r} is not valid JSON: {err}") from err
        if not isinstance(source, dict):
            raise FSDPConfigError(f"fsdp_config must be a dict, JSON text or a JSON file path, got "
                                  f"{type(source).__name__}")
        return cls._from_dict(source)

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> FSDPConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"replicate_only", "hybrid", "given"}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                raise FSDPConfigError(f"fsdp_config keys must be strings, got {key!r}")
            name = key[len("fsdp_"):] if key.startswith("fsdp_") else key
            name = _ALIASES.get(name, name)
            if name in IGNORED_FSDP1_KEYS:
                warnings.warn(f"fsdp_config key {key!r} is an FSDP1 setting with no effect under FSDP2; ignored",
                              stacklevel=3)
                continue
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(known)}"
                raise FSDPConfigError(f"unknown fsdp_config key {key!r}{hint}")
            values[name] = value
        config = cls()
        for name, value in values.items():
            setattr(config, name, value)
        config._validate(explicit=set(values))
        config.given = frozenset(values)
        return config

    def _validate(self, explicit: set[str]) -> None:
        def check_type(key: str, types: tuple[type, ...], allowed: str) -> None:
            value = getattr(self, key)
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                raise FSDPConfigError(f"fsdp_config key {key!r} got {value!r} ({type(value).__name__}); "
                                      f"expected {allowed}")

        for key in ("cpu_offload", "cpu_ram_efficient_loading", "forward_prefetch", "xla", "xla_fsdp_grad_ckpt",
                    "xla_fsdp_v2"):
            self._coerce_bool(key)
            check_type(key, (bool,), "true or false")
        self.activation_checkpointing = parse_activation_checkpointing(self.activation_checkpointing)
        if self.version == 1 or self.version == "1":
            raise FSDPConfigError("fsdp_config key 'version' is 1: FSDP1 is not supported by shardtrain; "
                                  "set 'version': 2 (FSDP2, the default)")
        if self.version not in (2, "2"):
            raise FSDPConfigError(f"fsdp_config key 'version' got {self.version!r}; allowed values: [2]")
        self.version = 2
        self._coerce_bool("reshard_after_forward")
        value = self.reshard_after_forward
        if not isinstance(value, bool) and not (isinstance(value, int) and value > 1):
            raise FSDPConfigError(f"fsdp_config key 'reshard_after_forward' got {value!r}; expected true, false, or "
                                  f"an int > 1 (reshard to that smaller world size after forward)")
        if isinstance(self.output_unit, str) and self.output_unit.strip().lower() == "auto":
            self.output_unit = "auto"
        else:
            self._coerce_bool("output_unit")
            check_type("output_unit", (bool,), "\"auto\", true or false")
        policy = str(self.auto_wrap_policy).upper()
        if policy not in WRAP_POLICIES:
            raise FSDPConfigError(f"fsdp_config key 'auto_wrap_policy' got {self.auto_wrap_policy!r}; allowed "
                                  f"values: {list(WRAP_POLICIES)}")
        self.auto_wrap_policy = policy
        classes = self.transformer_layer_cls_to_wrap
        if classes is None:
            classes = []
        if isinstance(classes, str):
            classes = [c.strip() for c in classes.split(",") if c.strip()]
        if not isinstance(classes, list | tuple) or not all(isinstance(c, str) for c in classes):
            raise FSDPConfigError(f"fsdp_config key 'transformer_layer_cls_to_wrap' got {classes!r}; expected a "
                                  f"list of class names or a comma-separated string")
        self.transformer_layer_cls_to_wrap = list(classes)
        if isinstance(self.min_num_params, str) and self.min_num_params.strip().isdigit():
            self.min_num_params = int(self.min_num_params)
        check_type("min_num_params", (int,), "a non-negative int")
        if self.min_num_params < 0:
            raise FSDPConfigError(f"fsdp_config key 'min_num_params' got {self.min_num_params}; expected >= 0")
        sdt = str(self.state_dict_type).upper()
        if sdt not in STATE_DICT_TYPES:
            raise FSDPConfigError(f"fsdp_config key 'state_dict_type' got {self.state_dict_type!r}; allowed values: "
                                  f"{list(STATE_DICT_TYPES)}")
        self.state_dict_type = sdt
        if self.mixed_precision is not None:
            mp = str(self.mixed_precision).lower()
            if mp not in MIXED_PRECISIONS:
                raise FSDPConfigError(f"fsdp_config key 'mixed_precision' got {self.mixed_precision!r}; allowed "
                                      f"values: {list(MIXED_PRECISIONS)}")
            self.mixed_precision = mp
        if self.dp_shard_size is not None:
            check_type("dp_shard_size", (int,), "a positive int")
            if self.dp_shard_size < 1:
                raise FSDPConfigError(f"fsdp_config key 'dp_shard_size' got {self.dp_shard_size}; expected >= 1")
        if not isinstance(self.xla_fsdp_settings, dict):
            raise FSDPConfigError(f"fsdp_config key 'xla_fsdp_settings' got {self.xla_fsdp_settings!r}; "
                                  f"expected a dict of PyTorch/XLA FSDP arguments")
        if (self.xla_fsdp_settings or self.xla_fsdp_grad_ckpt or self.xla_fsdp_v2) and not self.xla:
            raise FSDPConfigError("fsdp_config sets xla_fsdp_settings / xla_fsdp_grad_ckpt / xla_fsdp_v2 but "
                                  "'xla' is false; set 'xla': true to use the TPU path")
        if self.sharding_strategy is not None:
            self.apply_sharding_strategy(self.sharding_strategy, explicit_reshard="reshard_after_forward" in explicit)
        self._validate_layout()
        if self.activation_checkpointing and self.xla_fsdp_grad_ckpt:
            raise FSDPConfigError("fsdp_config sets both 'activation_checkpointing' and 'xla_fsdp_grad_ckpt'; "
                                  "keep one (xla_fsdp_grad_ckpt on TPU, activation_checkpointing elsewhere)")

    def _validate_layout(self) -> None:
        layout = self.layout.strip().lower() if isinstance(self.layout, str) else self.layout
        if layout in (None, "", "manual"):
            self.layout = None
        elif layout == "auto":
            self.layout = "auto"
        else:
            raise FSDPConfigError(f"fsdp_config key 'layout' got {self.layout!r}; allowed values: \"auto\" (the "
                                  f"planner chooses what you did not set) or \"manual\" (the keys as given)")
        if self.max_memory_per_rank is not None:
            self.max_memory_per_rank = as_bytes("fsdp_config key 'max_memory_per_rank'", self.max_memory_per_rank,
                                                FSDPConfigError)
            if self.layout != "auto":
                raise FSDPConfigError("fsdp_config sets 'max_memory_per_rank' without 'layout': \"auto\"; it is the "
                                      "budget the automatic layout fits under: add 'layout': \"auto\" or drop it")
        if self.layout == "auto" and self.xla:
            raise FSDPConfigError("fsdp_config sets 'layout': \"auto\" with 'xla': true; the automatic layout plans "
                                  "FSDP2 runs: drop 'layout' on the TPU path")

    @property
    def ac_mode(self) -> str:
        """`activation_checkpointing` as one of `AC_MODES`: "none", "full" or "selective".

        Parsed again here, since code may set the attribute after `load` (e.g. `"none"`, which is truthy).
        """
        value = parse_activation_checkpointing(self.activation_checkpointing)
        return "selective" if value == "selective" else ("full" if value else "none")

    def apply_sharding_strategy(self, strategy: Any, explicit_reshard: bool = False) -> None:
        """Map a legacy strategy (name or Accelerate integer) onto FSDP2 settings."""
        name = _normalize_strategy(strategy)
        reshard, replicate_only, hybrid = SHARDING_STRATEGIES[name]
        if explicit_reshard and bool(self.reshard_after_forward) != reshard and not replicate_only:
            raise FSDPConfigError(f"fsdp_config sets 'reshard_after_forward': {self.reshard_after_forward} but "
                                  f"'sharding_strategy': {name!r} means reshard_after_forward={reshard}; drop one")
        self.sharding_strategy = name
        self.reshard_after_forward = reshard if not explicit_reshard else self.reshard_after_forward
        self.replicate_only = replicate_only
        self.hybrid = hybrid

    def _coerce_bool(self, key: str) -> None:
        value = getattr(self, key)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            setattr(self, key, value.strip().lower() == "true")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (what `load` reads back)."""
        data = dataclasses.asdict(self)
        data.pop("replicate_only")
        data.pop("hybrid")
        data.pop("given")
        return data
