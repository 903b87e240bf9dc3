"""`on_engine` / `arguments_on_engine` compose a library's Trainer and arguments with shardtrain's."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import sentence_transformers
import transformers
import trl

import shardtrain
import shardtrain.train.trainer as engine_trainer
from shardtrain.errors import TrainingArgumentsError


class LibraryTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@dataclasses.dataclass
class LibraryArguments(transformers.TrainingArguments):
    library_knob: int = 3


def test_trainer_methods_of_the_library_come_first():
    composed = shardtrain.on_engine(LibraryTrainer)
    assert issubclass(composed, LibraryTrainer) and issubclass(composed, shardtrain.Trainer)
    mro = composed.__mro__
    assert mro.index(LibraryTrainer) < mro.index(shardtrain.Trainer) < mro.index(transformers.Trainer)
    assert composed.compute_loss is LibraryTrainer.compute_loss
    assert composed.labels_from_inputs is False  # batches reach the library's loss as its collator made them
    assert shardtrain.on_engine(LibraryTrainer) is composed  # one class per library class
    assert shardtrain.on_engine(shardtrain.Trainer) is shardtrain.Trainer


def test_arguments_keep_library_fields_and_our_checks(tmp_path):
    Args = shardtrain.arguments_on_engine(LibraryArguments)
    args = Args(str(tmp_path), library_knob=5, fsdp=True, cp_size=1)
    assert args.library_knob == 5 and args.fsdp_enabled and isinstance(args, shardtrain.TrainingArguments)
    with pytest.raises(TrainingArgumentsError, match="learning_rate"):
        Args(str(tmp_path), learning_rate=-1.0)


def test_not_a_trainer_is_refused():
    with pytest.raises(TrainingArgumentsError, match="transformers.Trainer subclass"):
        shardtrain.on_engine(dict)
    with pytest.raises(TrainingArgumentsError, match="TrainingArguments subclass"):
        shardtrain.arguments_on_engine(LibraryTrainer)


def test_accelerate_fsdp_flags_match_the_installed_accelerate():
    from accelerate.commands.launch import launch_command_parser

    from shardtrain.config.accelerate_env import FSDP_FLAGS

    parser = launch_command_parser()
    group = next(g for g in parser._action_groups if g.title == "FSDP Arguments")
    assert sorted(a.dest for a in group._group_actions) == sorted(FSDP_FLAGS)


def test_accelerate_environment_is_read_as_shardtrain_settings():
    from shardtrain.config.accelerate_env import from_environment
    from shardtrain.errors import LaunchConfigError

    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true",
           "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer,MixtralDecoderLayer", "FSDP_SHARDING_STRATEGY":
           "FULL_SHARD", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_FORWARD_PREFETCH": "true",
           "ACCELERATE_MIXED_PRECISION": "bf16"}
    got = from_environment(env)
    assert got.use_fsdp and got.mixed_precision == "bf16"
    assert got.fsdp == {"version": 2, "offload_params": "true", "forward_prefetch": "true",
                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "MixtralDecoderLayer"]}
    assert got.ignored == ()  # use_orig_params true: Accelerate's default, not reported
    assert from_environment({**env, "FSDP_SYNC_MODULE_STATES": "false"}).ignored == (
        "accelerate launch --fsdp_sync_module_states false (FSDP1 only; FSDP2 prefetches in backward and keeps "
        "original parameters by design)",)
    assert from_environment({}).use_fsdp is False
    with pytest.raises(LaunchConfigError, match="--use_deepspeed"):
        from_environment({"ACCELERATE_USE_DEEPSPEED": "true"})
    with pytest.raises(LaunchConfigError, match="torch_compile=True"):
        from_environment({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})


def test_a_stream_needs_max_steps(tmp_path):
    from torch.utils.data import IterableDataset

    from shardtrain.train.data.streaming import check_stream_arguments, is_stream

    class Stream(IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1, 2, 3]}

    assert is_stream(Stream()) and not is_stream([{"input_ids": [1]}])
    with pytest.raises(TrainingArgumentsError, match="set TrainingArguments.max_steps"):
        check_stream_arguments(shardtrain.TrainingArguments(str(tmp_path)))
    with pytest.raises(TrainingArgumentsError, match="save_strategy='steps'"):
        check_stream_arguments(shardtrain.TrainingArguments(str(tmp_path), max_steps=3, save_strategy="epoch"))


def test_the_engine_attributes_are_not_names_a_library_trainer_uses():
    """A composed trainer is one instance: a name the engine adds (beyond transformers.Trainer's) that a TRL or
    sentence-transformers trainer also uses would be overwritten by one of them (TRL's distillation trainer counts
    `self._step`). Read from the installed sources; `device` means the same device in both."""
    def names(text: str) -> set[str]:
        return set(re.findall(r"self\.(\w+)", text))

    hugging_face = names(inspect.getsource(transformers.trainer)) | set(dir(transformers.Trainer))
    added = names(inspect.getsource(engine_trainer)) - hugging_face
    assert {"_engine_step", "runtime", "loss_computer"} <= added  # the scan sees what the engine adds
    libraries = [*Path(trl.__file__).parent.rglob("*trainer*.py"),
                 *Path(sentence_transformers.__file__).parent.rglob("*trainer*.py")]
    assert len(libraries) > 10
    used = {path.name: names(path.read_text()) & added - {"device"} for path in libraries}
    assert {name: sorted(clash) for name, clash in used.items() if clash} == {}
