"""`on_engine` / `arguments_on_engine` compose a library's Trainer and arguments with shardtrain's."""

import dataclasses

import pytest
import transformers

import shardtrain
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
