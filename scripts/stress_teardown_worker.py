"""Worker for `stress_teardown.py` and tests/distributed/test_clean_exit.py: Trainer jobs, then exit.

    torchrun --nproc_per_node 2 scripts/stress_teardown_worker.py OUT_DIR [--jobs 3]
        [--teardown none|destroy|torch] [--raise-on-rank R]

Each job (one after the other in this process, as a user script would): a fresh tiny Llama (built from a
LlamaConfig, no downloads), a few training steps that write a SHARDED_STATE_DICT checkpoint, evaluate,
`save_model`. `--teardown none` (default) ends the script without touching the process group;
`--teardown destroy` calls `shardtrain.destroy_distributed()` at the end, `--teardown torch` calls
`torch.distributed.destroy_process_group()` directly. `--raise-on-rank R` makes rank R
raise after its first job (an error exit: the launch must fail promptly instead of hanging).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from shardtrain import Trainer, TrainingArguments, destroy_distributed


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def dataset(n: int = 48, seed: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 17, (n,), generator=gen).tolist()
    return [{"input_ids": torch.randint(1, 64, (length,), generator=gen).tolist()} for length in lengths]


def run_job(out: Path, index: int) -> None:
    data = dataset()
    args = TrainingArguments(output_dir=str(out / f"job{index}"), per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-2, logging_steps=1, fsdp=True, save_strategy="steps", save_steps=2,
                             save_total_limit=1, disable_tqdm=True,
                             fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"})
    trainer = Trainer(tiny_llama(index), args, train_dataset=data, eval_dataset=data[:16])
    trainer.train()
    trainer.evaluate()
    trainer.save_model(str(out / f"job{index}" / "final"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--teardown", choices=["none", "destroy", "torch"], default="none")
    parser.add_argument("--raise-on-rank", type=int, default=None)
    cli = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    for index in range(cli.jobs):
        run_job(Path(cli.out), index)
        if cli.raise_on_rank == rank:
            raise RuntimeError(f"rank {rank} fails on purpose after job {index}")
    if cli.teardown == "destroy":
        destroy_distributed()
    elif cli.teardown == "torch":
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
