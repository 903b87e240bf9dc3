"""`cpu_ram_efficient_loading` with a model object: the same training as the path, whichever way it was built.

torchrun --nproc_per_node 2 rank0_model.py OUT.json DIR

Rank 0 saves a tiny tied Llama to DIR/model. Then six Trainer runs (and one refused) (4 steps, FSDP2) start from it:
  * "path": Trainer(model=DIR/model): each rank reads its shards;
  * "meta": rank 0 passes `from_pretrained(DIR/model)`, ranks > 0 the model built on the meta device (no
    weights): they receive rank 0's;
  * "loaded": every rank passes `from_pretrained(DIR/model)`: trained as it is, with a warning that no memory
    was saved;
  * "device_map_meta": every rank passes `from_pretrained(DIR/model, device_map="meta", use_kernels=False)` (it
    reads no weight: "on_meta" records that every parameter was on the meta device); each rank reads its shards
    from DIR/model;
  * "meta_unnamed": every rank passes a model built on meta from a config that names no directory: the error;
  * "path_tp2" / "object_tp2": the path and a loaded model under tp 2 (the same global batch of 8).
Rank 0 writes each run's losses, final weights' max difference from "path", and its warnings and what the
loader logged ("warnings"), to OUT.json.
"""

import json
import logging
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from launch import LogLines
from tiny_models import tiny_llama, variable_length_dataset
from transformers import AutoConfig, LlamaForCausalLM

from shardtrain import Trainer, TrainingArguments, destroy_distributed, init_distributed
from shardtrain.errors import TrainingArgumentsError


def train(model, out: Path, **extra) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    knobs = {"per_device_train_batch_size": 4, "max_steps": 4, "learning_rate": 1e-2, "logging_steps": 1,
             "save_strategy": "no", "report_to": "none", "disable_tqdm": True, **extra}
    args = TrainingArguments(output_dir=str(out), fsdp=True, fsdp_config={"cpu_ram_efficient_loading": True},
                             **knobs)
    logger, said = logging.getLogger("shardtrain.parallel.loading"), LogLines()
    logger.setLevel(logging.INFO)
    logger.addHandler(said)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(model=model, args=args, train_dataset=variable_length_dataset(n=32))
        trainer.train()
    logger.removeHandler(said)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    weights = trainer.backend.full_model_state(trainer.model)
    ours = [str(w.message) for w in caught if "cpu_ram_efficient_loading" in str(w.message)]
    return losses, weights, ours + said.messages


def main() -> None:
    out, root = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed()
    rank = dist.get_rank()
    path = root / "model"
    if rank == 0:
        tiny_llama(seed=5, tie=True).save_pretrained(path)
    dist.barrier()
    runs = {"path": train(str(path), root / "path")}
    if rank == 0:
        model = LlamaForCausalLM.from_pretrained(str(path))
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM._from_config(AutoConfig.from_pretrained(str(path)))
    runs["meta"] = train(model, root / "meta")
    runs["loaded"] = train(LlamaForCausalLM.from_pretrained(str(path)), root / "loaded")
    # use_kernels=False: transformers >= 5.25 kernelizes by default, which raises on the meta device
    model = LlamaForCausalLM.from_pretrained(str(path), device_map="meta", use_kernels=False)
    on_meta = all(p.is_meta for p in model.parameters())
    runs["device_map_meta"] = train(model, root / "device_map_meta")
    config = AutoConfig.from_pretrained(str(path))
    config._name_or_path = ""  # built from a config alone: no directory named
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    try:
        train(model, root / "meta_unnamed")
        unnamed_error = None
    except TrainingArgumentsError as err:
        unnamed_error = str(err)
    # tensor parallel over both ranks: the path's sharded read fills 2-D (fsdp x tp) DTensors
    runs["path_tp2"] = train(str(path), root / "path_tp2", tp_size=2, per_device_train_batch_size=8)
    runs["object_tp2"] = train(LlamaForCausalLM.from_pretrained(str(path)), root / "object_tp2", tp_size=2,
                               per_device_train_batch_size=8)
    if rank == 0:
        ref = runs["path"][1]
        result = {name: {"losses": losses, "warnings": caught, "keys": sorted(weights) == sorted(ref),
                         "max_weight_diff": max((weights[k] - ref[k]).abs().max().item() for k in ref)}
                  for name, (losses, weights, caught) in runs.items()}
        pair = runs["path_tp2"][1], runs["object_tp2"][1]
        result["device_map_meta"]["on_meta"] = on_meta
        result["meta_unnamed_error"] = unnamed_error
        result["tp2_pair_max_weight_diff"] = max((pair[0][k] - pair[1][k]).abs().max().item() for k in ref)
        out.write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
