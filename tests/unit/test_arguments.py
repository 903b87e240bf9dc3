"""TrainingArguments: validation at construction, messages naming the field, launch environment."""

import json

import pytest
import torch
from transformers import HfArgumentParser

from shardtrain import TrainingArguments, TrainingArgumentsError


@pytest.mark.parametrize("kwargs,fragments", [
    ({"per_device_train_batch_size": -1}, ["per_device_train_batch_size", "-1"]),
    ({"per_device_train_batch_size": 0}, ["per_device_train_batch_size"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps"]),
    ({"learning_rate": -1.0}, ["learning_rate"]),
    ({"max_steps": 0}, ["max_steps"]),
    ({"lr_scheduler_type": "cosine_warm"}, ["lr_scheduler_type", "cosine_warm", "linear"]),
    ({"optim": "adafactor"}, ["optim", "adafactor", "adamw_torch_fused", "adamw_torch"]),
    ({"report_to": "wandbb"}, ["report_to", "wandbb", "wandb", "tensorboard", "mlflow"]),
    ({"save_strategy": "best"}, ["save_strategy", "best", "eval_strategy"]),
    ({"deepspeed": "ds.json"}, ["deepspeed", "FSDP2"]),
    ({"logging_steps": 2.5}, ["logging_steps", "2.5"]),
    ({"lr_scheduler_kwargs": "{bad"}, ["lr_scheduler_kwargs", "JSON"]),
    ({"eval_strategy": "sometimes"}, ["eval_strategy", "sometimes"]),
    ({"warmup_steps": -3}, ["warmup_steps"]),
    ({"bf16": True, "fp16": True}, ["bf16", "fp16"]),
    ({"save_total_limit": 0}, ["save_total_limit"]),
    ({"fsdp": True, "gradient_checkpointing": True, "fsdp_config": {"activation_checkpointing": True}},
     ["gradient_checkpointing", "activation_checkpointing"]),
    ({"cp_size": 2, "sp_size": 2}, ["cp_size", "sp_size"]),
    ({"fsdp": True, "save_only_model": True, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}},
     ["save_only_model", "SHARDED_STATE_DICT"]),
    ({"fsdp": True, "save_only_model": True, "load_best_model_at_end": True, "eval_strategy": "steps",
      "eval_steps": 5, "save_steps": 5}, ["save_only_model", "load_best_model_at_end"]),
    ({"load_best_model_at_end": True}, ["load_best_model_at_end", "eval_strategy"]),
    ({"fsdp": True, "fsdp_config": {"reshard_after_forwad": True}}, ["fsdp_config", "reshard_after_forward"]),
    ({"fsdp": "fulll_shard"}, ["fsdp", "fulll_shard"]),
    ({"save_strategy": "best", "eval_strategy": "steps", "eval_steps": 2}, ["save_strategy", "metric_for_best_model"]),
    ({"label_smoothing_factor": 1.5}, ["label_smoothing_factor", "1.5"]),
    ({"neftune_noise_alpha": -1}, ["neftune_noise_alpha"]),
    ({"fsdp": True, "cp_size": 2, "neftune_noise_alpha": 5.0}, ["neftune_noise_alpha", "context"]),
    ({"label_smoothing_factor": 0.1, "loss_chunk_size": 64}, ["label_smoothing_factor", "loss_chunk_size"]),
    ({"tf32": True}, ["tf32"]),
    ({"optim": "adafactor"}, ["optim", "sgd", "elementwise"]),
    ({"include_for_metrics": ["inputs", "loss"]}, ["include_for_metrics", "'loss'", "micro-batch mean"]),
])
def test_bad_arguments_name_the_field(tmp_path, kwargs, fragments):
    with pytest.raises(TrainingArgumentsError) as err:
        TrainingArguments(output_dir=str(tmp_path), **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_defaults_and_fsdp_resolution(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path))
    assert not args.fsdp_enabled and args.mixed_precision == "no" and args.report_to == []
    args = TrainingArguments(output_dir=str(tmp_path), fsdp="shard_grad_op offload", bf16=True)
    assert args.fsdp_enabled and args.fsdp_config.reshard_after_forward is False and args.fsdp_config.cpu_offload
    assert args.mixed_precision == "bf16"
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert args.report_to == []


def test_launch_environment_is_picked_up(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTRAIN_USE_FSDP", "1")
    monkeypatch.setenv("SHARDTRAIN_FSDP_CONFIG", json.dumps({"reshard_after_forward": False,
                                                             "transformer_layer_cls_to_wrap": ["BertLayer"]}))
    monkeypatch.setenv("SHARDTRAIN_MIXED_PRECISION", "bf16")
    args = TrainingArguments(output_dir=str(tmp_path))
    assert args.fsdp_enabled and args.bf16
    assert args.fsdp_config.transformer_layer_cls_to_wrap == ["BertLayer"]
    assert args.fsdp_config.reshard_after_forward is False
    explicit = TrainingArguments(output_dir=str(tmp_path), fsdp_config={"cpu_offload": True})
    assert explicit.fsdp_config.cpu_offload and explicit.fsdp_config.transformer_layer_cls_to_wrap == []


def test_an_argument_the_user_passed_beats_the_environment_even_at_its_default(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTRAIN_USE_FSDP", "1")
    monkeypatch.setenv("SHARDTRAIN_MIXED_PRECISION", "bf16")
    implicit = TrainingArguments(output_dir=str(tmp_path))
    assert implicit.fsdp_enabled and implicit.bf16
    explicit = TrainingArguments(output_dir=str(tmp_path), fsdp=False, bf16=False)
    assert not explicit.fsdp_enabled and not explicit.bf16 and explicit.mixed_precision == "no"
    # the same from a command line: an absent flag leaves the launcher's setting, a given one wins
    parser = HfArgumentParser(TrainingArguments)
    (absent,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    (given,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--fsdp", "false", "--bf16",
                                                   "false"])
    assert absent.fsdp_enabled and absent.bf16
    assert not given.fsdp_enabled and not given.bf16


@pytest.mark.parametrize("word,enabled", [("1", True), ("true", True), ("YES", True), ("on", True),
                                          ("0", False), ("False", False), ("no", False), ("off", False), ("", False)])
def test_environment_true_false_words(tmp_path, monkeypatch, word, enabled):
    monkeypatch.setenv("SHARDTRAIN_USE_FSDP", word)
    assert TrainingArguments(output_dir=str(tmp_path)).fsdp_enabled is enabled


def test_ddp_timeout_and_save_async_are_checked(tmp_path):
    assert TrainingArguments(output_dir=str(tmp_path)).ddp_timeout == 1800  # Hugging Face's default
    with pytest.raises(TrainingArgumentsError, match="save_async"):
        TrainingArguments(output_dir=str(tmp_path), save_async="yes")


def test_activation_checkpointing_argument_keeps_a_selective_fsdp_config(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, activation_checkpointing=True,
                             fsdp_config={"activation_checkpointing": "selective"})
    assert args.fsdp_config.activation_checkpointing == "selective"
    assert TrainingArguments(output_dir=str(tmp_path), fsdp=True,
                             activation_checkpointing=True).fsdp_config.activation_checkpointing is True


def test_it_is_a_transformers_training_arguments_with_a_positional_output_dir(tmp_path):
    import dataclasses

    import transformers

    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2)
    assert isinstance(args, transformers.TrainingArguments) and args.output_dir == str(tmp_path)
    assert args.eval_strategy == transformers.IntervalStrategy.NO  # Hugging Face's own enums and derived values
    assert args.world_size == 1 and args.process_index == 0 and args.device.type == "cpu"

    @dataclasses.dataclass
    class MyArguments(TrainingArguments):  # a user's subclass, as TRL and others write them
        beta: float = 0.1

    mine = MyArguments(str(tmp_path), beta=0.5)
    assert mine.beta == 0.5 and mine.output_dir == str(tmp_path) and not mine.fsdp_enabled


def test_activation_checkpointing_without_fsdp_is_the_models_own(tmp_path):
    args = TrainingArguments(str(tmp_path), activation_checkpointing=True)
    assert args.gradient_checkpointing is True  # Hugging Face's meaning: model.gradient_checkpointing_enable()


def test_batch_eval_metrics_needs_a_compute_result_argument(tmp_path):
    from shardtrain.train.args.checks import check_compute_metrics

    args = TrainingArguments(output_dir=str(tmp_path), batch_eval_metrics=True)
    with pytest.raises(TrainingArgumentsError, match="batch_eval_metrics = True .*compute_result"):
        check_compute_metrics(args, lambda prediction: {})
    check_compute_metrics(args, lambda prediction, compute_result: {})
    check_compute_metrics(TrainingArguments(output_dir=str(tmp_path)), lambda prediction: {})


def test_bf16_without_a_gpu_needs_the_cpu_chosen_as_transformers_and_trl_say(tmp_path, monkeypatch):
    """TRL's configs turn bf16 on by default; on a machine without a GPU transformers (so TRL) refuses it unless
    use_cpu is set. Ours says so the same way, in one error naming the fix, instead of running without a word."""
    import torch
    import transformers
    import trl

    import shardtrain.trl

    assert not torch.cuda.is_available()
    monkeypatch.delenv("SHARDTRAIN_CPU", raising=False)
    with pytest.raises(ValueError, match="use_cpu"):
        trl.SFTConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="use_cpu"):
        transformers.TrainingArguments(output_dir=str(tmp_path), bf16=True)
    for build in (lambda: shardtrain.trl.SFTConfig(output_dir=str(tmp_path)),
                  lambda: TrainingArguments(output_dir=str(tmp_path), bf16=True)):
        with pytest.raises(TrainingArgumentsError, match=r"bf16 = True but no GPU is visible here .* set "
                                                         r"use_cpu=True \(or `shardtrain launch --cpu`\)"):
            build()
    assert trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True).bf16  # what both then run: bf16 on CPU
    assert shardtrain.trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True).bf16
    monkeypatch.setenv("SHARDTRAIN_CPU", "1")  # shardtrain launch --cpu
    assert TrainingArguments(output_dir=str(tmp_path), bf16=True).bf16


def test_a_library_config_is_taken_over_without_the_fields_its_post_init_derived(tmp_path):
    """TRL's GRPOConfig derives generation_batch_size from steps_per_generation in __post_init__; handed to the
    engine (GRPOTrainer builds one when given no args) it is taken over without passing both back, which TRL's
    own __post_init__ would refuse as "both configured"."""
    import warnings

    import trl

    from shardtrain.train.args.handover import engine_arguments

    given = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=2,
                           per_device_train_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        taken = engine_arguments(given)
    assert (taken.generation_batch_size, taken.steps_per_generation) == (given.generation_batch_size,
                                                                        given.steps_per_generation)
    assert taken.num_generations == 2 and taken.per_device_train_batch_size == 4


def test_checkpointing_kwargs_keep_transformers_none_so_enabling_again_passes_use_reentrant(tmp_path):
    """TRL's GRPO turns the model's checkpointing off for generation and on again with
    `args.gradient_checkpointing_kwargs`: None gives transformers' use_reentrant=False; {} made torch warn."""
    import warnings

    import trl
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardtrain.trl

    theirs = trl.GRPOConfig(str(tmp_path / "t"), use_cpu=True, bf16=False)
    ours = shardtrain.trl.GRPOConfig(str(tmp_path / "o"), use_cpu=True, bf16=False)
    plain = TrainingArguments(str(tmp_path / "p"), gradient_checkpointing=True)
    assert ours.gradient_checkpointing_kwargs is theirs.gradient_checkpointing_kwargs is None
    assert plain.activation_checkpointing_kwargs is None and plain.gradient_checkpointing_kwargs is None
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.gradient_checkpointing_enable(ours.gradient_checkpointing_kwargs)
    model.train()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    assert not [w for w in seen if "use_reentrant" in str(w.message)]
