"""`layout: "auto"` when the process group is already up: the candidates are traced in a fresh Python process.

The planner runs its own fake process group, which cannot coexist with a real one in the same process; TRL's
trainers (and any script that calls `init_distributed()` first) start the real one before the Trainer. Then rank 0
describes the model in plain JSON — its transformers class and config, each parameter's dtype, and every peft adapter
config if it is a `PeftModel`; a model directory as its path — and a child interpreter (`python -m
shardtrain.plan.fresh_process IN OUT`, the parent's `sys.path` as its `PYTHONPATH`) rebuilds it on the meta device,
traces every candidate (`plan.candidates`) and writes them back as JSON. Nothing is pickled either way. A model that
JSON cannot describe (a plain `nn.Module`, a quantized model, a class defined in the `__main__` script or inside a
function) gets a clear error instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import FSDPConfigError

IMPLEMENTATIONS = ("_attn_implementation", "_experts_implementation")  # config attributes to_dict() leaves out


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(path: str) -> type:
    module, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _refuse(what: str) -> FSDPConfigError:
    return FSDPConfigError(f"fsdp_config 'layout': \"auto\" with the process group already started rebuilds the "
                           f"model in a fresh process from its transformers class and config, and {what}; create the "
                           "Trainer before the process group starts, or set the layout by hand ('layout': "
                           "\"manual\"; `shardtrain plan` predicts each one)")


def describe(model: Any, adapter_dir: Path) -> dict[str, Any]:
    """The model as plain JSON the child can rebuild it from: a model directory as it is; a live model as its class,
    config and every parameter's dtype, with each of a `PeftModel`'s adapter configs saved under `adapter_dir`
    (peft's own `adapter_config.json`, the active adapter first).

    Raises:
        FSDPConfigError: not a transformers model (or a peft model of one), a quantized one, or a class a fresh
            process cannot import (defined in the `__main__` script or inside a function).
    """
    from transformers import PreTrainedModel

    from shardtrain.train.model.lora import is_peft_model

    if isinstance(model, str | os.PathLike):
        return {"path": str(model)}
    adapters: list[list[str]] = []
    base = model
    if is_peft_model(model):
        names = [model.active_adapter, *(n for n in model.peft_config if n != model.active_adapter)]
        for index, name in enumerate(names):
            model.peft_config[name].save_pretrained(str(adapter_dir / str(index)))
            adapters.append([name, str(adapter_dir / str(index))])
        base = model.get_base_model()
    if not isinstance(base, PreTrainedModel):
        raise _refuse(f"this model ({type(base).__name__}) is not a transformers PreTrainedModel (nor a peft model "
                      "of one)")
    if getattr(base, "is_quantized", False) or getattr(base.config, "quantization_config", None):
        raise _refuse(f"{type(base).__name__} is quantized, which a model rebuilt from its config is not")
    for cls in (type(base), type(base.config)):
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            raise _refuse(f"{cls.__name__} is defined in the script being run (or inside a function), where a "
                          "fresh process cannot import it: move it into a module")
    config = base.config
    return {"class": _class_path(type(base)), "config_class": _class_path(type(config)), "config": config.to_dict(),
            "implementations": {key: getattr(config, key) for key in IMPLEMENTATIONS
                                if isinstance(getattr(config, key, None), str)},
            "adapters": adapters,
            # per parameter: peft keeps adapters in fp32 on a bf16 base, and some models keep modules in fp32
            "dtypes": {name: str(p.dtype).removeprefix("torch.") for name, p in model.named_parameters()}}


def rebuild(described: dict[str, Any]) -> torch.nn.Module | str:
    """The described model on the meta device, its adapters added as peft adds them and every parameter in its
    recorded dtype (a model directory: its path, which the planner reads itself).

    Raises:
        FSDPConfigError: the rebuilt model's parameters are not the described ones.
    """
    if "path" in described:
        return described["path"]
    config = _import_class(described["config_class"]).from_dict(described["config"])
    for key, value in described["implementations"].items():
        setattr(config, key, value)  # not in to_dict(); attention kernels differ in what they keep for backward
    with torch.device("meta"):
        model = _import_class(described["class"])._from_config(config)
    if described["adapters"]:
        from peft import PeftConfig, get_peft_model

        (first, path), *others = described["adapters"]
        model = get_peft_model(model, PeftConfig.from_pretrained(path), adapter_name=first)
        for name, path in others:
            model.add_adapter(name, PeftConfig.from_pretrained(path))
    dtypes = described["dtypes"]
    rebuilt = dict(model.named_parameters())
    if set(rebuilt) != set(dtypes):
        missing, extra = sorted(set(dtypes) - set(rebuilt))[:3], sorted(set(rebuilt) - set(dtypes))[:3]
        raise FSDPConfigError(f"the model rebuilt from its config has other parameters than the live one (missing "
                              f"{missing}, extra {extra})")
    for name, param in rebuilt.items():  # in place: tied parameters stay one tensor
        param.data = param.data.to(getattr(torch, dtypes[name]))
    return model


# timeout: under NCCL's default collective timeout (10 min), which the other ranks wait in meanwhile, so that a
# hung child ends in this error on every rank rather than in a collective timeout
CHILD_TIMEOUT_S = 480


def trace_in_fresh_process(model: Any, config: FSDPConfig, request: Any) -> tuple[list[Any], Any]:
    """`candidates.trace_candidates` of `model`, run by a child interpreter (no process group there).

    Raises:
        FSDPConfigError: the model cannot be described (see `describe`), or the child failed or took longer than
            `CHILD_TIMEOUT_S` (its error's end).
    """
    from shardtrain.plan.candidates import Candidate

    with tempfile.TemporaryDirectory(prefix="shardtrain-auto-") as tmp:
        work = Path(tmp)
        job = {"model": describe(model, work / "adapters"), "request": dataclasses.asdict(request),
               "fsdp_config": {**dataclasses.asdict(config), "given": sorted(config.given)}}
        (work / "in.json").write_text(json.dumps(job))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # the child is no rank of this job
        command = [sys.executable, "-m", "shardtrain.plan.fresh_process", str(work / "in.json"), str(work / "out.json")]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FSDPConfigError(f"fsdp_config 'layout': \"auto\" traced the model in a fresh process, which took "
                                  f"longer than {CHILD_TIMEOUT_S} s; set the layout by hand ('layout': \"manual\"), or "
                                  "create the Trainer before the process group starts") from None
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-12:])
            raise FSDPConfigError(f"fsdp_config 'layout': \"auto\" traced the model in a fresh process, which "
                                  f"failed (exit {done.returncode}); set the layout by hand ('layout': "
                                  f"\"manual\"). Its error:\n{tail}")
        out = json.loads((work / "out.json").read_text())
    return [Candidate(**c) for c in out["candidates"]], tuple(out["gemm"]) if out["gemm"] else None


def main(argv: list[str]) -> None:
    """The child: read the job, trace, write the candidates (an `FSDPConfigError` is printed and exits 1)."""
    from shardtrain.plan.candidates import Request, trace_candidates

    job = json.loads(Path(argv[0]).read_text())
    fields = job["fsdp_config"]
    config = FSDPConfig(**{**fields, "given": frozenset(fields["given"])})
    try:
        candidates, gemm = trace_candidates(rebuild(job["model"]), config, Request(**job["request"]))
    except FSDPConfigError as err:
        print(err, file=sys.stderr)
        raise SystemExit(1) from None
    Path(argv[1]).write_text(json.dumps({"candidates": [dataclasses.asdict(c) for c in candidates],
                                         "gemm": list(gemm) if gemm else None}))


if __name__ == "__main__":
    main(sys.argv[1:])
