"""Which `transformers.TrainingArguments` fields shardtrain implements, accepts without effect, or refuses.

`TrainingArguments` subclasses Hugging Face's, so every field exists with its type, default and help text and
`HfArgumentParser` parses Hugging Face command lines unchanged. A field shardtrain does not implement, set to
a value other than its default, either has no effect here
(one warning lists them all) or would change results in a way shardtrain cannot honour (an error naming the
field and what to do instead). `compatibility_table` renders this as the table of docs/hugging-face.md; a test keeps the
two equal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers

# A non-default value of these would change what is trained or evaluated; refusing beats silently differing.
REFUSED: dict[str, str] = {
    "deepspeed": "shardtrain shards with FSDP2; drop --deepspeed and use --fsdp / fsdp_config",
    "optim_target_modules": "only torch's elementwise optimizers are available",
}

# Accepted and ignored, with the reason given in the warning and the table of docs/hugging-face.md.
NO_EFFECT: dict[str, str] = {
    "local_rank": "set by launchers; shardtrain reads RANK / LOCAL_RANK from torchrun",
    "eval_do_concat_batches": "evaluation predictions are always concatenated",
    "include_num_input_tokens_seen": "always tracked (TrainerState.num_input_tokens_seen)",
    "full_determinism": "CPU runs are deterministic; resume is bit-identical by construction",
    "save_on_each_node": "rank 0 writes shared files once (multi-node needs a shared filesystem)",
    "log_on_each_node": "rank 0 logs",
    "use_liger_kernel": "the model runs as built; liger kernels are not applied",
    "eval_use_gather_object": "predictions are always gathered as arrays",
    "dataloader_persistent_workers": "the DataLoader is rebuilt once per epoch",
    "eval_accumulation_steps": "predictions move to host memory after every batch (device memory stays bounded)",
}
DEFAULT_NO_EFFECT_REASON = "no effect in shardtrain"


def hf_fields() -> dict[str, dataclasses.Field]:
    """The fields of the installed transformers' `TrainingArguments`, by name."""
    return {f.name: f for f in dataclasses.fields(transformers.TrainingArguments) if f.init}


def default_of(name: str) -> Any:
    field = hf_fields()[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _value(value: Any) -> Any:
    return getattr(value, "value", value)  # enums compare by value


def _is_default(value: Any, default: Any) -> bool:
    value, default = _value(value), _value(default)
    if isinstance(value, bool) and isinstance(default, str):  # HfArgumentParser turns a str|bool default into bool
        return value == (default.lower() in ("yes", "true", "t", "y", "1", "all"))
    return value == default or (value in (None, "", [], {}) and not default)


def check_mirrored(args: Any, implemented: set[str]) -> tuple[list[str], str | None]:
    """(warnings, error) for the mirrored fields of `args` that differ from Hugging Face's default."""
    ignored, refused = [], None
    for name in hf_fields():
        if name in implemented or name == "local_rank":
            continue
        value = getattr(args, name)
        if _is_default(value, default_of(name)):
            continue
        if name in REFUSED and refused is None:
            refused = f"TrainingArguments.{name}={value!r} is not supported: {REFUSED[name]}"
        elif name not in REFUSED:
            ignored.append(f"{name}={value!r}")
    warnings = []
    if ignored:
        warnings.append("these TrainingArguments fields have no effect in shardtrain and are ignored: "
                        + ", ".join(ignored) + " (see the compatibility table in docs/hugging-face.md)")
    return warnings, refused


def compatibility_rows(implemented: set[str], ours: set[str], notes: dict[str, str]) -> list[tuple[str, str, str]]:
    """(field, status, note) for every Hugging Face field and every field of our own, sorted by name."""
    rows = []
    for name in sorted(set(hf_fields()) | ours):
        if name in ours:
            rows.append((name, "shardtrain only", notes.get(name, "")))
        elif name in implemented:
            rows.append((name, "supported", notes.get(name, "")))
        elif name in REFUSED:
            rows.append((name, "default only", REFUSED[name]))
        else:
            rows.append((name, "no effect", NO_EFFECT.get(name, DEFAULT_NO_EFFECT_REASON)))
    return rows


def compatibility_table(rows: list[tuple[str, str, str]]) -> str:
    """The rows as a Markdown table (headed by the transformers version it was generated from)."""
    lines = [f"Fields of transformers {transformers.__version__}:", "", "| field | status | note |", "|---|---|---|"]
    lines += [f"| `{name}` | {status} | {note} |" for name, status, note in rows]
    return "\n".join(lines) + "\n"


# Fields that are ours (not Hugging Face's), and what the compatibility table (docs/hugging-face.md) says of some
# fields.
OUR_FIELDS = {"cp_size", "cp_regather_kv", "sp_size", "tp_size", "tp_plan", "ep_size", "pp_size", "pp_schedule",
              "pp_microbatches", "pp_layers", "save_async", "fault_tolerance",
              "loss_chunk_size", "pack_sequences", "step_guard", "predict_with_generate", "generation_max_length",
              "generation_num_beams"}
FIELD_NOTES = {
    "cp_size": "context-parallel size: sequences split over cp ranks (causal LMs; see docs/parallelism.md)",
    "parallelism_config": "accelerate ParallelismConfig or dict: dp_replicate/dp_shard/cp/tp sizes",
    "cp_regather_kv": "context parallel: all-gather K/V again in backward instead of keeping them (less memory)",
    "sp_size": "Ulysses sequence-parallel size (refused above 1)",
    "tp_size": "tensor-parallel size: the model's own TP plan on the tp mesh, FSDP over the rest (see "
               "docs/parallelism.md)",
    "tp_plan": "module-name pattern -> transformers style string; default: the model's own plan",
    "ep_size": "expert-parallel size: MoE experts spread over ep ranks (inside dp_shard x cp x tp; see "
               "docs/parallelism.md)",
    "pp_size": "pipeline-parallel size: the model's layers split into pp stages by its pp plan (torch.distributed."
               "pipelining; see docs/parallelism.md)",
    "pp_schedule": "the pipeline schedule: GPipe, 1F1B (default); two stages per rank: Interleaved1F1B, LoopedBFS, "
                   "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV",
    "pp_microbatches": "pipeline microbatches each micro-batch is split into (default: the pipeline's stages)",
    "pp_layers": "decoder layers of each pipeline stage, in stage order (default: an even split)",
    "save_async": "write checkpoints in the background (DCP async save)",
    "fault_tolerance": "replica groups on torchft: a lost group stops itself, not the job; it heals from a peer "
                       "(see docs/fault-tolerance.md)",
    "loss_chunk_size": "tokens per chunk of LM head + fp32 cross entropy (no full logits); 'auto'; None: off",
    "batch_eval_metrics": "compute_metrics(EvalPrediction, compute_result) after every batch, on the batch "
                          "gathered from every rank (tensors); evaluate() keeps no predictions",
    "include_for_metrics": "['inputs']: EvalPrediction.inputs, the model's main input per row in dataset order "
                           "(padding cut as for predictions); 'loss' is refused (a micro-batch mean)",
    "pack_sequences": "causal LMs: each training micro-batch is one padding-free row (DataCollatorWithFlattening); "
                      "documents kept apart; evaluation stays padded",
    "step_guard": "skip a step whose global loss or gradient norm is not finite (opt-in: a loss spike) on every "
                  "rank together; its batch is recorded and never fed again (see docs/step-guard.md)",
    "torch_compile": "each FSDP unit (e.g. decoder layer) compiled before sharding, torchtitan's way; not with ep",
    "predict_with_generate": "as Seq2SeqTrainingArguments: evaluate/predict generate answers (causal LMs)",
    "generation_max_length": "as Seq2SeqTrainingArguments (total length); default: the longest answer, new tokens",
    "generation_num_beams": "as Seq2SeqTrainingArguments",
    "report_to": "transformers' integrations (wandb, mlflow, trackio, tensorboard, ...), 'all', 'none'; rank 0; "
                 "metrics.jsonl is always written",
    "optim": "'adamw_torch_fused', 'adamw_torch', 'sgd', 'adagrad', 'rmsprop' (Hugging Face's create_optimizer)",
    "lr_scheduler_type": "transformers' schedulers; reduce_lr_on_plateau and greedy step on metric_for_best_model "
                         "after each evaluation, as Hugging Face's",
    "fsdp": "FSDP2 (fully_shard); legacy strings map to fsdp_config",
    "bf16": "unset: the launcher's mixed precision",
    "save_strategy": "'no', 'steps', 'epoch', 'best'",
    "dataloader_drop_last": "an epoch's short last global batch is left out (training and evaluation); without it "
                            "nothing is dropped (short batches are completed with ignored samples)",
    "auto_find_batch_size": "on out of memory: the per-device batch halved and the accumulation steps doubled, so "
                            "the global batch and the losses stay the same (Hugging Face changes the global batch)",
    "label_names": "the batch keys evaluation returns as label_ids (several: a tuple), as Hugging Face; the loss is "
                   "the model's for names other than 'labels'",
    "skip_memory_metrics": "False: Hugging Face's memory metrics (per stage); peak memory per rank is always logged",
    "train_sampling_strategy": "'random' (a seeded permutation per epoch, the same on any layout) or 'sequential' "
                               "(the dataset's order); the length-grouping ones are refused",
    "eval_delay": "as Hugging Face (its DefaultFlowCallback): no evaluation before that step (epoch)",
    "use_cpu": "CPU and gloo even when a GPU is visible",
    "activation_checkpointing": "under FSDP: fsdp_config activation_checkpointing; else the model's own",
    "label_smoothing_factor": "exact (token and class cross entropy); refused with a model's own loss",
    "neftune_noise_alpha": "transformers' NEFTune hook on the input embeddings while training (not with tp/cp)",
    "logging_nan_inf_filter": "as Hugging Face: a non-finite step loss is replaced in the logged average",
    "enable_jit_checkpoint": "always on: SIGTERM checkpoints the last finished step and exits 143",
    "tf32": "Hugging Face's own setting (CUDA only)",
    "torch_empty_cache_steps": "empties the CUDA cache every N steps, as Hugging Face",
    "use_cache": "as Hugging Face: sets model.config.use_cache (off: packed rows get block-diagonal masks)",
    "average_tokens_across_devices": "compute_loss's scale (x ranks), as Hugging Face; the step loss is the global "
                                     "token mean either way",
}
