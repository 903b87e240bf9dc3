"""The training side of `shardtrain verify`: a run of the user's own script, capped and measured.

`shardtrain verify` starts the script with SHARDTRAIN_VERIFY set to a JSON request; the script's
`TrainingArguments` take it (`apply_request`: K steps, a log entry per step, no saving, no evaluation, no
trackers, the batch split the layout needs, an output directory of verify's own), and the Trainer writes what
the step did when training ends (`write_dump`), then ends the script with exit status 0 (whatever the script
meant to do afterwards is not part of the comparison).

    SHARDTRAIN_VERIFY='{"dump": "/tmp/v/run1", "max_steps": 5, "per_device_train_batch_size": 4,
                        "gradient_accumulation_steps": 2}' torchrun ... train.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shardtrain.config import env
from shardtrain.errors import TrainingArgumentsError

DUMP_FILE = "verify.json"  # per step: loss, grad norm; the batch split; a layout-dependent loss, if any
WEIGHTS_FILE = "weights.safetensors"  # the final weights, whole, in the model's parameter order

# Losses whose value depends on which samples share a micro-batch (in-batch negatives): sentence-transformers'.
# Dropout is the other layout dependence by nature (masks drawn per rank); `layout_dependence` names either.
IN_BATCH_NEGATIVES = frozenset({
    "MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss", "GISTEmbedLoss", "CachedGISTEmbedLoss", "MegaBatchMarginLoss",
    "ContrastiveTensionLossInBatchNegatives", "BatchAllTripletLoss", "BatchHardTripletLoss",
    "BatchHardSoftMarginTripletLoss", "BatchSemiHardTripletLoss"})


def request() -> dict[str, Any] | None:
    """The verify request of this process (SHARDTRAIN_VERIFY), or None for a normal run.

    Raises:
        TrainingArgumentsError: the variable is not a JSON object with a "dump" directory.
    """
    raw = os.environ.get(env.VERIFY)
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise TrainingArgumentsError(f"environment variable {env.VERIFY} is not valid JSON ({err}); it is set by "
                                     f"`shardtrain verify`: unset it to train normally") from None
    if not isinstance(data, dict) or not data.get("dump"):
        raise TrainingArgumentsError(f"environment variable {env.VERIFY} must be a JSON object with a \"dump\" "
                                     f"directory; it is set by `shardtrain verify`: unset it to train normally")
    return data


def apply_request(args: Any, wanted: dict[str, Any]) -> None:
    """Cap and quiet the run (called by `TrainingArguments.__post_init__` before its checks)."""
    args.output_dir = str(Path(wanted["dump"]) / "output")
    args.max_steps = int(wanted.get("max_steps", 5))
    args.logging_strategy, args.logging_steps, args.logging_first_step = "steps", 1, False
    args.save_strategy, args.eval_strategy, args.load_best_model_at_end = "no", "no", False
    args.report_to, args.push_to_hub, args.resume_from_checkpoint = "none", False, None
    args.auto_find_batch_size = False
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if wanted.get(name) is not None:
            setattr(args, name, int(wanted[name]))


def layout_dependence(trainer: Any) -> str | None:
    """Why the script's run depends on the layout by nature (in-batch negatives, dropout), or None."""
    import torch

    loss = getattr(trainer, "loss", None)
    modules = loss.values() if isinstance(loss, dict) else [loss]
    for module in modules:
        name = type(module).__name__
        if name in IN_BATCH_NEGATIVES:
            return (f"{name} takes its negatives from the other samples of the micro-batch, so a sample's loss "
                    f"depends on which samples share its micro-batch: on the number of ranks and the "
                    f"accumulation steps")
    dropout = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p]
    config = getattr(getattr(trainer, "model", None), "config", None)
    attention = float(getattr(config, "attention_dropout", 0) or 0) if config is not None else 0.0
    if dropout or attention:
        where = f"{len(dropout)} dropout modules (p up to {max(dropout, default=attention):g})" if dropout else \
            f"attention_dropout {attention:g}"
        return (f"the model has {where}: each rank draws its own masks, so the samples' masks depend on the "
                f"layout; turn dropout off to compare the rest of the script")
    return None


def write_dump(trainer: Any, wanted: dict[str, Any]) -> None:
    """Rank 0 writes the per-step figures and the final weights (collective: every rank calls it)."""
    import torch
    from safetensors.torch import save_file

    from shardtrain.parallel.states import full_model_state

    weights = full_model_state(trainer.model)  # collective: rank 0 gets the model whole
    if trainer.rank != 0:
        return
    out = Path(wanted["dump"])
    out.mkdir(parents=True, exist_ok=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "step" in entry]
    save_file({name: tensor.detach().to(torch.float32).contiguous() for name, tensor in weights.items()},
              str(out / WEIGHTS_FILE))
    (out / DUMP_FILE).write_text(json.dumps({
        "layout": trainer.dims.describe(), "world_size": trainer.dims.world_size,
        "data_ranks": trainer.dims.batch_size,
        "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "steps": [entry["step"] for entry in logs], "losses": [entry["loss"] for entry in logs],
        "grad_norms": [entry.get("grad_norm") for entry in logs],
        "parameters": list(weights), "layout_dependent": layout_dependence(trainer)}, indent=1))
