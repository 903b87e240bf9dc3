"""Train tiny Llamas with FSDP2 and save them with every `save_model` path; record what each rank gathered.

torchrun --nproc_per_node N sharded_save.py OUT SPLIT_BYTES
For "llama" (vocab 66: uneven shards over 4 ranks) and "llama_tied": 2 training steps with a sharded checkpoint
at step 2, then rank 0 writes OUT/<model>/weights.pt (the gathered reference), and save_model writes
OUT/<model>/{single (default split), split (SPLIT_BYTES per file), gather (the rank-0 path, SPLIT_BYTES),
resave (split, then single into the same directory, then a split save that fails on the last rank)}; then a
FULL_STATE_DICT run writes OUT/<model>/full/checkpoint-2 and another resumes from it (OUT/<model>/full_resumed).
Each rank writes OUT/<model>/rank<r>.json: bytes of full tensors it gathered (DTensor.redistribute to Replicate) during
each save (and during the FULL_STATE_DICT run and its resume), the files it consolidated, and how often it read a
whole full checkpoint (`read_full_checkpoint`, the rank-0 load path).
"""

import json
import sys
from pathlib import Path

import torch
from tiny_models import tiny_llama, variable_length_dataset
from torch.distributed.tensor import DTensor

import shardtrain.checkpoint.async_manager as async_manager
import shardtrain.checkpoint.hf_export as hf_export
import shardtrain.checkpoint.manager as manager
from shardtrain import Trainer, TrainingArguments, destroy_distributed
from shardtrain.errors import OutputDirError
from shardtrain.parallel.states import full_model_state

COUNTS = {"full_tensor_bytes": 0, "consolidated": [], "whole_reads": 0, "rank0_gathers": 0}


def _count_gathers(original):
    # DTensor.full_tensor and get_model_state_dict(full_state_dict=True) both gather through redistribute
    def redistribute(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if any(p.is_shard() for p in self.placements) and all(p.is_replicate() for p in result.placements):
            COUNTS["full_tensor_bytes"] += result.numel() * result.element_size()
        return result
    return redistribute


def _record_consolidation(original):
    def consolidate(*, fqn_to_file_mapping, **kwargs):
        COUNTS["consolidated"].extend(sorted(set(fqn_to_file_mapping.values())))
        return original(fqn_to_file_mapping=fqn_to_file_mapping, **kwargs)
    return consolidate


def _record_whole_reads(original):
    def read_full_checkpoint(*args, **kwargs):
        COUNTS["whole_reads"] += 1
        return original(*args, **kwargs)
    return read_full_checkpoint


def _record_rank0_gathers(original):
    def gather_full(*args, **kwargs):
        COUNTS["rank0_gathers"] += 1
        return original(*args, **kwargs)
    return gather_full


def _full_checkpoint_runs(name: str, out: Path) -> dict:
    """Train 3 steps with FULL_STATE_DICT checkpoints (one at step 2), then resume from checkpoint-2 in a new
    Trainer, and the same training with save_async; what each did gather or read whole."""
    record = {}
    for kind, resume in (("full", None), ("full_resumed", str(out / "full" / "checkpoint-2")), ("full_async", None)):
        COUNTS.update(full_tensor_bytes=0, consolidated=[], whole_reads=0, rank0_gathers=0)
        args = TrainingArguments(output_dir=str(out / kind), fsdp=True, per_device_train_batch_size=4, max_steps=3,
                                 learning_rate=1e-2, save_strategy="steps", save_steps=2, disable_tqdm=True,
                                 logging_steps=1, fsdp_config={"state_dict_type": "FULL_STATE_DICT"},
                                 save_async=kind == "full_async")
        trainer = Trainer(tiny_llama(tie=name == "llama_tied", vocab=66), args,
                          train_dataset=variable_length_dataset(n=32))
        trainer.train(resume_from_checkpoint=resume)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        record[kind] = {**json.loads(json.dumps(COUNTS)), "losses": losses}
    return record


def _failing_save(trainer, out: Path, split: int) -> str | None:
    """save_model over a good save while the last rank's consolidation fails: the error every rank raised."""
    original = hf_export._consolidate_safetensors_files

    def disk_full(**kwargs):
        raise OSError(28, "No space left on device (injected)")

    if trainer.rank == trainer.world_size - 1:
        hf_export._consolidate_safetensors_files = disk_full
    try:
        trainer.save_model(str(out), _max_shard_bytes=split)
    except OutputDirError as err:
        return str(err)
    finally:
        hf_export._consolidate_safetensors_files = original
    return None


def main() -> None:
    root, split = Path(sys.argv[1]), int(sys.argv[2])
    DTensor.redistribute = _count_gathers(DTensor.redistribute)
    hf_export._consolidate_safetensors_files = _record_consolidation(hf_export._consolidate_safetensors_files)
    manager.read_full_checkpoint = _record_whole_reads(manager.read_full_checkpoint)
    async_manager.gather_full = _record_rank0_gathers(async_manager.gather_full)
    for name in ("llama", "llama_tied"):
        out = root / name
        model = tiny_llama(tie=name == "llama_tied", vocab=66)
        args = TrainingArguments(output_dir=str(out), fsdp=True, per_device_train_batch_size=4, max_steps=2,
                                 learning_rate=1e-2, save_strategy="steps", save_steps=2, disable_tqdm=True,
                                 fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"})
        trainer = Trainer(model, args, train_dataset=variable_length_dataset(n=32))
        trainer.train()
        weights = full_model_state(trainer.model)
        if trainer.rank == 0:
            torch.save(weights, out / "weights.pt")
        del weights
        record = {}
        for kind, options in (("single", {}), ("split", {"_max_shard_bytes": split}),
                              ("gather", {"_max_shard_bytes": split, "_gather_on_rank0": True})):
            COUNTS.update(full_tensor_bytes=0, consolidated=[])
            trainer.save_model(str(out / kind), **options)
            record[kind] = json.loads(json.dumps(COUNTS))  # a copy: the later saves go on counting
        trainer.save_model(str(out / "resave"), _max_shard_bytes=split)  # then one file over the split layout
        trainer.save_model(str(out / "resave"))
        record["failed"] = _failing_save(trainer, out / "resave", split)
        record.update(_full_checkpoint_runs(name, out))
        (out / f"rank{trainer.rank}.json").write_text(json.dumps(record))
    destroy_distributed()


if __name__ == "__main__":
    main()
