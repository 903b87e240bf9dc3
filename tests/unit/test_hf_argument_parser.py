"""`HfArgumentParser` builds the same parser from shardtrain's TrainingArguments as from transformers', and a
command line with the training flags of Hugging Face's example READMEs parses to the same values."""

import dataclasses
from dataclasses import dataclass, field

import pytest
import transformers
from transformers import HfArgumentParser

from shardtrain import TrainingArguments
from shardtrain.train.arguments import IMPLEMENTED, OURS

# flags from the language-modeling, text-classification and FSDP docs' command lines (training arguments only)
ARGV = [
    "--output_dir", "OUT", "--do_train", "--do_eval", "--do_predict", "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "2", "--gradient_accumulation_steps", "2", "--learning_rate", "2e-5",
    "--weight_decay", "0.01", "--adam_beta2", "0.98", "--adam_epsilon", "1e-6", "--max_grad_norm", "0.5",
    "--num_train_epochs", "3", "--max_steps", "100", "--lr_scheduler_type", "cosine_with_min_lr",
    "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}', "--warmup_steps", "0.1", "--logging_steps", "10",
    "--logging_first_step", "--eval_strategy", "steps", "--eval_steps", "0.25", "--save_strategy", "steps",
    "--save_steps", "50", "--save_total_limit", "2", "--load_best_model_at_end", "--metric_for_best_model",
    "accuracy", "--seed", "7", "--data_seed", "11", "--bf16", "--optim", "adamw_torch", "--report_to", "none",
    "--dataloader_num_workers", "1", "--remove_unused_columns", "false", "--ddp_timeout", "600",
    "--fsdp", "full_shard auto_wrap", "--gradient_checkpointing", "true", "--use_cpu",
    "--resume_from_checkpoint", "OUT/checkpoint-50", "--disable_tqdm", "true", "--run_name", "exp1",
    "--eval_on_start", "--prediction_loss_only", "false", "--dataloader_pin_memory", "false",
]


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None)


def _normal(value):
    value = getattr(value, "value", value)
    return value


def test_same_command_line_same_values(tmp_path):
    argv = [str(tmp_path) if a == "OUT" else a.replace("OUT", str(tmp_path)) for a in ARGV]
    ours_model, ours = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses(
        ["--model_name_or_path", "m", *argv])
    with pytest.warns(UserWarning, match="ddp_find_unused_parameters"):  # a field with no effect is named
        TrainingArguments(output_dir=str(tmp_path), ddp_find_unused_parameters=True)
    _, theirs = HfArgumentParser((ModelArguments, transformers.TrainingArguments)).parse_args_into_dataclasses(
        ["--model_name_or_path", "m", *argv])
    assert ours_model.model_name_or_path == "m"
    skip = {"fsdp", "fsdp_config", "report_to", "bf16", "fp16", "gradient_checkpointing_kwargs",
            "lr_scheduler_kwargs", "disable_tqdm", "resume_from_checkpoint", "gradient_checkpointing",
            "activation_checkpointing", "activation_checkpointing_kwargs", "greater_is_better",  # ours, checked below
            }
    compared = (IMPLEMENTED - OURS) - skip  # the fields we implement mean the same; the rest are only accepted
    assert len(compared) > 35
    for name in compared:
        assert _normal(getattr(ours, name)) == _normal(getattr(theirs, name)), name
    assert {f.name for f in dataclasses.fields(transformers.TrainingArguments)} <= \
        {f.name for f in dataclasses.fields(ours)}
    assert ours.fsdp_enabled and ours.fsdp_config.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert ours.bf16 is True and ours.fp16 is False and ours.report_to == []
    assert ours.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and ours.gradient_checkpointing is True
    assert ours.greater_is_better is True and ours.resume_from_checkpoint == str(tmp_path / "checkpoint-50")
    assert ours.interval("eval_steps", 100) == 25 and ours.warmup_for(100) == 10
