"""A pipeline run's model from a directory (each rank reads its stage's shards) and from rank 0
(cpu_ram_efficient_loading: the other ranks build it on the meta device), against the model in memory.

torchrun --nproc_per_node 2 pipeline_loading.py OUT_DIR
Writes OUT_DIR/losses.json: {"memory": [...], "directory": [...], "rank0": [...]} (the losses of 3 steps).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist
from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments, destroy_distributed


def losses(model, out: Path, rank0: bool = False) -> list[float]:
    args = TrainingArguments(output_dir=tempfile.mkdtemp(dir=out), fsdp=True, per_device_train_batch_size=4,
                             max_steps=3, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                             pp_size=2, fsdp_config={"cpu_ram_efficient_loading": rank0})
    trainer = Trainer(model, args, train_dataset=variable_length_dataset(n=32))
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def main() -> None:
    out = Path(sys.argv[1])
    directory = out / "model"
    memory = losses(tiny_llama(tie=True, layers=4), out)
    if dist.get_rank() == 0:
        tiny_llama(tie=True, layers=4).save_pretrained(directory)
    dist.barrier()
    from_directory = losses(str(directory), out)
    with_meta = tiny_llama(tie=True, layers=4)
    if dist.get_rank() > 0:  # (to the meta device: the pair is two parameters there; the config says tied)
        with_meta = with_meta.to("meta")
    from_rank0 = losses(with_meta, out, rank0=True)
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps({"memory": memory, "directory": from_directory,
                                                     "rank0": from_rank0}))
    destroy_distributed()


if __name__ == "__main__":
    main()
