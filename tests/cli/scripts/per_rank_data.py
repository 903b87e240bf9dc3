"""A script whose ranks build their own data: each draws its samples from a seed of its own.

    shardtrain verify --cpu --layouts 2 tests/cli/scripts/per_rank_data.py

One process trains the samples of seed 3; on 2 ranks, rank 1 trains samples one process never sees.
"""

import os

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments

data = variable_length_dataset(n=64, seed=3 + int(os.environ.get("RANK", 0)))  # the bug: data per rank
args = TrainingArguments(output_dir="out/per_rank_data", per_device_train_batch_size=8, max_steps=3,
                         learning_rate=1e-2, report_to="none", save_strategy="no")
Trainer(tiny_llama(), args, train_dataset=data).train()
