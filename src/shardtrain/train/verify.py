"""The training side of `shardtrain verify`: a run of the user's own script, capped and measured.

`shardtrain verify` starts the script with SHARDTRAIN_VERIFY set to a JSON request; the script's
`TrainingArguments` take it (`apply_request`: K steps, a log entry per step, no saving, no evaluation, no
trackers, the batch split the layout needs, an output directory of verify's own), and the Trainer adds a
`VerifyProbe` callback: at the start of training it turns dropout off (each rank draws its own masks: no layout
could share them) and records the evidence verify reads causes from (each rank's random state, the initial
weights, each step's samples); when training ends it writes what the steps did (`write_dump`), then ends the
script with exit status 0 (whatever the script meant to do afterwards is not part of the comparison).
`"reverse_rows": true` collates each micro-batch's samples in reverse order: the one-process run again with
another summation order, which measures the run's own rounding.

    SHARDTRAIN_VERIFY='{"dump": "/tmp/v/run1", "max_steps": 5, "per_device_train_batch_size": 4,
                        "gradient_accumulation_steps": 2}' torchrun ... train.py
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

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
    args.auto_find_batch_size, args.dataloader_num_workers = False, 0  # (the probe wraps the collator)
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if wanted.get(name) is not None:
            setattr(args, name, int(wanted[name]))


def layout_dependence(trainer: Any) -> str | None:
    """Why the script's run depends on the layout by nature (in-batch negatives), or None."""
    loss = getattr(trainer, "loss", None)
    modules = loss.values() if isinstance(loss, dict) else [loss]
    for module in modules:
        name = type(module).__name__
        if name in IN_BATCH_NEGATIVES:
            return (f"{name} takes its negatives from the other samples of the micro-batch, so a sample's loss "
                    f"depends on which samples share its micro-batch: on the number of ranks and the "
                    f"accumulation steps")
    return None


def turn_off_dropout(model: Any) -> str | None:
    """Set every dropout of `model` to 0 (modules, and attention dropout read from attributes); what was on."""
    import torch

    modules = [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p]
    attention = [m for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float)
                 and m.attention_dropout]
    if not modules and not attention:
        return None
    p = max([m.p for m in modules] + [m.attention_dropout for m in attention], default=0.0)
    for m in modules:
        m.p = 0.0
    for m in attention:
        m.attention_dropout = 0.0
    return f"{len(modules)} dropout modules and {len(attention)} attention dropouts" + (f" (p up to {p:g})" if p
                                                                                          else "")


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class _ReversedRows:
    """A collator that collates the samples in reverse order; every other attribute is the wrapped one's (a
    library reads its collator's settings, e.g. sentence-transformers' `valid_label_columns`)."""

    def __init__(self, collate: Callable) -> None:
        self._collate = collate

    def __call__(self, items: list) -> Any:
        return self._collate(list(items)[::-1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collate, name)


class VerifyProbe(TrainerCallback):
    """The run's evidence for `shardtrain verify` and its end (see the module docstring); every rank has one."""

    def __init__(self, trainer: Any, wanted: dict[str, Any]) -> None:
        self.trainer, self.wanted = trainer, wanted
        self.samples: dict[int, list[str]] = {}  # step -> fingerprints of the rows this rank trained
        self.start: dict[str, Any] = {}
        if wanted.get("reverse_rows"):
            trainer.data_collator = _ReversedRows(trainer.data_collator)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        import torch

        from shardtrain.parallel import collectives
        from shardtrain.parallel.states import full_model_state

        self.start["dropout_off"] = turn_off_dropout(model)
        self.start["rng"] = collectives.gather_objects(digest(torch.get_rng_state().numpy().tobytes()))
        weights = full_model_state(model)  # collective: rank 0 gets the model whole
        self.start["weights"] = digest(b"".join(t.detach().float().contiguous().numpy().tobytes()
                                                for t in weights.values())) if self.trainer.rank == 0 else None
        # a model's rows as each rank gets them (split under context parallelism, packed: not comparable)
        if self.trainer.dims.cp == 1 and not getattr(args, "pack_sequences", False):
            model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: Any, inputs: tuple, kwargs: dict) -> None:
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if not module.training or ids is None or ids.dim() != 2:
            return
        rows = self.samples.setdefault(self.trainer.state.global_step + 1, [])
        for i in range(ids.shape[0]):
            row = ids[i][mask[i].bool()] if mask is not None and mask.shape == ids.shape else ids[i]
            rows.append(digest(row.detach().cpu().numpy().tobytes()))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        write_dump(self.trainer, self.wanted, self)
        raise SystemExit(0)


def write_dump(trainer: Any, wanted: dict[str, Any], probe: VerifyProbe) -> None:
    """Rank 0 writes the per-step figures, the evidence and the final weights (collective: every rank calls it)."""
    import torch
    from safetensors.torch import save_file

    from shardtrain.parallel import collectives
    from shardtrain.parallel.states import full_model_state

    weights = full_model_state(trainer.model)  # collective: rank 0 gets the model whole
    shares = collectives.gather_objects((trainer.runtime.dp_rank, probe.samples))
    if trainer.rank != 0:
        return
    by_rank = dict(shares)  # one share per data-parallel rank (its tensor / context peers saw the same rows)
    samples: dict[int, list[str]] = {}
    for share in by_rank.values():
        for step, rows in share.items():
            samples.setdefault(step, []).extend(rows)
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
        "parameters": list(weights), "layout_dependent": layout_dependence(trainer),
        "dropout_off": probe.start.get("dropout_off"), "rng_at_start": probe.start.get("rng"),
        "initial_weights": probe.start.get("weights"),
        "samples": {str(step): sorted(rows) for step, rows in sorted(samples.items())} if samples else None},
        indent=1))
