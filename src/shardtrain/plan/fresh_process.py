"""`layout: "auto"` when the process group is already up: the candidates are traced in a fresh Python process.

The planner runs its own fake process group, which cannot coexist with a real one in the same process; TRL's
trainers (and any script that calls `init_distributed()` first) start the real one before the Trainer. Then rank 0
describes the model in plain JSON — its transformers class and config, its parameters' dtype, and peft's LoRA
config if it is a `PeftModel` — and a child interpreter (`python -m shardtrain.plan.fresh_process IN OUT`, the
parent's `sys.path` as its `PYTHONPATH`) rebuilds it on the meta device, traces every candidate and writes them
back as JSON. Nothing is pickled either way. A model that JSON cannot describe (a plain `nn.Module`, a class
defined in the `__main__` script) gets a clear error instead.
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


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(path: str) -> type:
    module, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def describe(model: Any, adapter_dir: Path) -> dict[str, Any]:
    """The model as plain JSON the child can rebuild it from; a `PeftModel`'s active adapter config is saved to
    `adapter_dir` (peft's own `adapter_config.json`).

    Raises:
        FSDPConfigError: not a transformers model (or a peft model of one), or its class lives in `__main__`.
    """
    from transformers import PreTrainedModel

    from shardtrain.train.model.lora import is_peft_model

    described: dict[str, Any] = {"adapter_dir": None}
    base = model
    if is_peft_model(model):
        model.peft_config[model.active_adapter].save_pretrained(str(adapter_dir))
        described["adapter_dir"] = str(adapter_dir)
        base = model.get_base_model()
    if not isinstance(base, PreTrainedModel):
        raise FSDPConfigError(f"fsdp_config 'layout': \"auto\" with the process group already started rebuilds the "
                              f"model in a fresh process from its transformers class and config, and this model "
                              f"({type(base).__name__}) is not a transformers PreTrainedModel (nor a peft model of "
                              "one); create the Trainer before the process group starts, or set the layout by hand "
                              "('layout': \"manual\"; `shardtrain plan` predicts each one)")
    for cls in (type(base), type(base.config)):
        if cls.__module__ == "__main__":
            raise FSDPConfigError(f"fsdp_config 'layout': \"auto\" with the process group already started "
                                  f"rebuilds the model in a fresh process, which cannot import {cls.__name__}: it is "
                                  "defined in the script being run; move it into a module, create the Trainer "
                                  "before the process group starts, or set the layout by hand ('layout': \"manual\")")
    dtypes = {p.dtype for p in base.parameters() if p.is_floating_point()}
    return {**described, "class": _class_path(type(base)), "config_class": _class_path(type(base.config)),
            "config": base.config.to_dict(), "attn_implementation": getattr(base.config, "_attn_implementation", None),
            "dtype": str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"}


def rebuild(described: dict[str, Any]) -> torch.nn.Module:
    """The described model on the meta device (LoRA adapters added as peft adds them)."""
    config = _import_class(described["config_class"]).from_dict(described["config"])
    if described["attn_implementation"]:
        config._attn_implementation = described["attn_implementation"]
    with torch.device("meta"):
        model = _import_class(described["class"])._from_config(config)
    model = model.to(getattr(torch, described["dtype"]))
    if described["adapter_dir"]:
        from peft import PeftConfig

        from shardtrain.train.model.lora import add_adapters

        model = add_adapters(model, PeftConfig.from_pretrained(described["adapter_dir"]))
    return model


def trace_in_fresh_process(model: Any, config: FSDPConfig, request: Any) -> tuple[list[Any], Any]:
    """`auto_layout.trace_candidates` of `model`, run by a child interpreter (no process group there).

    Raises:
        FSDPConfigError: the model cannot be described (see `describe`), or the child failed (its error's end).
    """
    from shardtrain.plan.auto_layout import Candidate

    with tempfile.TemporaryDirectory(prefix="shardtrain-auto-") as tmp:
        work = Path(tmp)
        job = {"model": describe(model, work / "adapter"), "request": dataclasses.asdict(request),
               "fsdp_config": {**dataclasses.asdict(config), "given": sorted(config.given)}}
        (work / "in.json").write_text(json.dumps(job))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # the child is no rank of this job
        done = subprocess.run([sys.executable, "-m", "shardtrain.plan.fresh_process", str(work / "in.json"),
                               str(work / "out.json")], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-12:])
            raise FSDPConfigError(f"fsdp_config 'layout': \"auto\" traced the model in a fresh process, which "
                                  f"failed (exit {done.returncode}); set the layout by hand ('layout': "
                                  f"\"manual\"). Its error:\n{tail}")
        out = json.loads((work / "out.json").read_text())
    return [Candidate(**c) for c in out["candidates"]], tuple(out["gemm"]) if out["gemm"] else None


def main(argv: list[str]) -> None:
    """The child: read the job, trace, write the candidates (an `FSDPConfigError` is printed and exits 1)."""
    from shardtrain.plan.auto_layout import Request, trace_candidates

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
