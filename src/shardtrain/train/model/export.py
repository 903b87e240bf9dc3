"""`ModelExport`: what `Trainer.save_model` writes, a directory `from_pretrained` loads, from a parallelised model.

    ModelExport(backend).save(model, Path("out"), processing_class=tokenizer, args_json=args.to_json_string())

A whole FSDP2 model is written by every rank, none holding it whole (`checkpoint/hf_export.py`); adapters,
merged adapters, XLA and non-float states are gathered on rank 0.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from shardtrain.checkpoint.full import DEFAULT_MAX_SHARD_BYTES, write_full_checkpoint
from shardtrain.checkpoint.hf_export import save_sharded_pretrained, sharded_state, unsupported
from shardtrain.checkpoint.hf_files import write_beside_model
from shardtrain.checkpoint.model_state import model_config_dict
from shardtrain.errors import CheckpointError, OutputDirError, TrainingArgumentsError
from shardtrain.parallel.collectives import agree
from shardtrain.parallel.pipeline_split import stage_split
from shardtrain.parallel.states import TorchStates, gather_stages
from shardtrain.train.args.hf_methods import owner
from shardtrain.train.data.validation import writable_problem
from shardtrain.train.model.lora import is_peft_model, merged_state, stage_adapters, write_adapter


class ModelExport:
    """Writes a parallelised model in Hugging Face's layout. Every rank calls `save` (it is collective).

    Args:
        backend: the Trainer's backend (its name, rank, world size and `full_model_state`).
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def save(self, model: nn.Module, out: Path, *, processing_class: Any = None, args_json: str | None = None,
             merge_adapters: bool = False, gather_on_rank0: bool = False,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
        """Write config.json (with `architectures`), safetensors, generation_config.json for generative models,
        the processing class's files and training_args.json (`args_json`) into `out`.

        The directory is checked before the model is gathered, and a failed write raises `OutputDirError` on
        every rank. A PEFT model writes its adapter (what `PeftModel.from_pretrained(base, dir)` loads), or with
        `merge_adapters` the base with the adapters merged in (peft's `merge_and_unload`). `gather_on_rank0`
        forces the rank-0 path (the benchmark compares the two).
        """
        rank = self.backend.rank
        agree(writable_problem(out, "save_model directory") if rank == 0 else None, OutputDirError)
        side_files = self._side_files(out, processing_class, args_json)
        if not (gather_on_rank0 or is_peft_model(model)) and self.backend.name == "fsdp2":
            sharded = sharded_state(model)
            if unsupported(sharded) is None:
                save_sharded_pretrained(model, out, model_config_dict(model), rank=rank,
                                        world_size=self.backend.world_size, state=sharded,
                                        max_shard_bytes=max_shard_bytes,
                                        agree=lambda problem: agree(problem, OutputDirError))
                self._on_rank0(out, lambda: side_files(model))
                return out
        adapters_only = is_peft_model(model) and not merge_adapters
        if adapters_only and stage_split(model) is not None:  # each stage picks its adapters (peft reads the
            state = gather_stages(model, stage_adapters(model))  # modules), rank 0 joins them
        else:
            state = self.backend.full_model_state(model, trainable_only=adapters_only)

        def write() -> None:
            if adapters_only:
                write_adapter(model, state, out, picked=stage_split(model) is not None)
                side_files(model)
                return
            merge = merge_adapters and is_peft_model(model)
            weights, written = merged_state(model, state) if merge else (state, model)
            write_full_checkpoint(weights, out, model_config_dict(written), max_shard_bytes)
            side_files(written)

        self._on_rank0(out, write)
        return out

    def _on_rank0(self, out: Path, work: Callable[[], None]) -> None:
        """Run `work` on rank 0; if it fails to write, every rank raises OutputDirError."""
        problem = None
        if self.backend.rank == 0:
            try:
                work()
            except OSError as err:
                problem = f"could not write the model to {out}: {err}; free space or choose another directory"
        agree(problem, OutputDirError)

    @staticmethod
    def _side_files(out: Path, processing_class: Any, args_json: str | None) -> Callable[[nn.Module], None]:
        """generation_config.json (generative models), the processing class's files, training_args.json."""
        def write(model: nn.Module) -> None:
            write_beside_model(out, model, processing_class)
            if args_json is not None:
                (out / "training_args.json").write_text(args_json)
        return write


def write_model_card(out: Path, *, name: str, model: nn.Module, args: Any, state: Any, world_size: int) -> None:
    """Hugging Face's `create_model_card`, short: `out/README.md` saying what was trained, how, and the last
    logged evaluation."""
    evals = [e for e in state.log_history if any(k.startswith("eval_") for k in e)]
    lines = ["---", "library_name: transformers", "tags:", "- shardtrain", "- generated_from_trainer", "---", "",
             f"# {name}", "", f"`{type(model).__name__}` trained with shardtrain (FSDP2) for {state.global_step} "
             f"steps on {world_size} rank(s).", "", "## Training hyperparameters", ""]
    for key in ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                "lr_scheduler_type", "warmup_steps", "max_steps", "num_train_epochs", "optim"):
        lines.append(f"- {key}: {getattr(args, key)}")
    if evals:
        lines += ["", "## Results", "", "```json", json.dumps(evals[-1], indent=2), "```"]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device (no memory), kept to rebuild the whole model on one process."""
    return _moved(model, lambda copied: copied.to("meta"))


def materialize(meta_model: nn.Module) -> nn.Module:
    """A CPU copy of `meta_model` (a `skeleton`) with empty tensors, for the gathered weights to be loaded into."""
    return _moved(meta_model, lambda copied: copied.to_empty(device="cpu"))


def _moved(model: nn.Module, move: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """A deep copy of `model` moved by `move`, its tied parameters still one parameter: a move to another device
    makes a new parameter per module, which would leave an alias (a masked-LM decoder tied to the word
    embeddings) apart from the weight that is loaded once."""
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    moved = move(copy.deepcopy(model))
    for first, *others in aliases.values():
        for name in others:
            owner_name, _, attribute = name.rpartition(".")
            setattr(moved.get_submodule(owner_name), attribute, moved.get_parameter(first))
    return moved


def save_through_override(trainer: Any, output_dir: Path) -> Path:
    """A Trainer subclass's overridden `_save(output_dir)` (sentence-transformers' writer), called as Hugging Face
    calls it: on rank 0, with `trainer.model` the whole model (a CPU copy built from the gathered weights and the
    skeleton kept before sharding; code written for an unsharded model reads whole tensors). Collective: its
    failure is raised on every rank."""
    name = f"{owner(type(trainer), '_save').__qualname__}._save"
    if trainer.spec.xla or trainer._save_skeleton is None:
        raise TrainingArgumentsError(f"{name} writes a whole model on one process, which the XLA backend (or a "
                                     "model given by path) does not keep; remove the override to save the "
                                     "engine's way")
    full = TorchStates(trainer.model, None).full_model_state()  # collective: rank 0 holds the model whole
    problem = None
    if trainer.rank == 0:
        sharded = trainer.model
        try:
            trainer.model = materialize(trainer._save_skeleton)
            trainer.model.load_state_dict(full, strict=False)  # tied aliases: the same parameter, loaded once
            trainer._save(str(output_dir))
        except Exception as err:  # every rank raises it below
            problem = f"{name} failed: {type(err).__name__}: {err}"
        finally:
            trainer.model = sharded
    del full
    agree(problem, CheckpointError)
    return output_dir
