"""The method contract (`shardtrain.train.args.hf_methods`): every method of the installed transformers.Trainer is
classified once, the documentation's table is the code's, an override of a replaced method is refused when the class is
built (naming the method), and every TRL and sentence-transformers trainer either builds on the engine or is
refused for a method it overrides."""

import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

import pytest
import transformers

import shardtrain
from shardtrain import Trainer
from shardtrain.errors import TrainerOverrideError
from shardtrain.train.args.hf_methods import AUDITED, HONOURED, INHERITED, REPLACED, hf_methods, replaced_overrides

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compat_table", REPO / "scripts" / "compat_table.py")
compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat)


def test_every_method_of_transformers_trainer_is_classified_once():
    ours = {name for name in vars(Trainer) if name in hf_methods()}
    groups = [ours, set(HONOURED), set(INHERITED), set(REPLACED)]
    assert set().union(*groups) == hf_methods(), "classify the new methods in hf_methods.py"
    assert sum(len(g) for g in groups) == len(hf_methods()), "a method is in two groups"
    for name in ("_get_train_sampler", "_get_eval_sampler", "_load_optimizer_and_scheduler"):
        assert name in ours  # the engine defines them, with Hugging Face's signature
        assert inspect.signature(getattr(Trainer, name)).parameters.keys() == \
            inspect.signature(getattr(transformers.Trainer, name)).parameters.keys()


def test_documented_methods_table_matches_the_code():
    text = (REPO / "docs" / "hugging-face.md").read_text()
    assert compat.page_with_tables(text, compat.PAGES["hugging-face.md"]) == text, \
        "docs/hugging-face.md's tables are stale: run .venv/bin/python scripts/compat_table.py --write"


@pytest.mark.parametrize("name", ["_maybe_log_save_evaluate", "_load_from_checkpoint", "_load_best_model",
                                  "_inner_training_loop", "get_batch_samples"])
def test_overriding_a_replaced_method_is_refused_when_the_class_is_built(name):
    with pytest.raises(TrainerOverrideError, match=rf"MyTrainer\.{name} overrides transformers\.Trainer\.{name}, "
                                                   r"which shardtrain's engine never calls") as caught:
        type("MyTrainer", (Trainer,), {name: lambda self, *a, **k: None, "__module__": __name__})
    assert REPLACED[name].split(";")[0] in str(caught.value)  # what does the job instead, and the fix


def test_a_library_class_overriding_a_replaced_method_is_refused_by_on_engine():
    library = type("OnlineThing", (transformers.Trainer,), {"_maybe_log_save_evaluate": lambda self, *a: None})
    with pytest.raises(TrainerOverrideError, match=r"OnlineThing\._maybe_log_save_evaluate"):
        shardtrain.on_engine(library)


def library_trainers() -> list[type]:
    """Every transformers.Trainer subclass that TRL and sentence-transformers define (their importable modules)."""
    found = {}
    for package in ("trl", "sentence_transformers"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            if "trainer" not in info.name.rsplit(".", 1)[-1]:
                continue
            try:
                module = importlib.import_module(info.name)
            except Exception:  # an optional dependency of an experimental trainer (vllm, ...) is missing
                continue
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, transformers.Trainer) \
                        and value.__module__ == module.__name__:
                    found[f"{value.__module__}.{value.__qualname__}"] = value
    return list(found.values())


def test_every_library_trainer_builds_on_the_engine_or_is_refused_for_a_named_method():
    trainers = library_trainers()
    assert len(trainers) >= 15
    refused, built = {}, []
    for cls in trainers:
        overrides = replaced_overrides(cls, engine=Trainer)
        if overrides:
            with pytest.raises(TrainerOverrideError, match=overrides[0][0]):
                shardtrain.on_engine(cls)
            refused[cls.__name__] = [name for name, _ in overrides]
        else:
            assert issubclass(shardtrain.on_engine(cls), Trainer)
            built.append(cls.__name__)
    for name in ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RLOOTrainer", "KTOTrainer", "RewardTrainer",
                 "SentenceTransformerTrainer"):
        assert name in built
    # the only library overrides of replaced methods: TRL's experimental trainers that run loops of their own
    assert set(refused) <= {"OnlineDPOTrainer", "AsyncGRPOTrainer", "AsyncDistillationTrainer"}, refused
    for key in AUDITED:  # every audited override still exists where it was read
        module, cls_name, method = key.rsplit(".", 2)
        assert method in vars(getattr(importlib.import_module(module), cls_name))
