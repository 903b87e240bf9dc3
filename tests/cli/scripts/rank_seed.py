"""A model with dropout, and a seed set per rank after the Trainer's own: each rank draws other dropout masks
than one process would.

    shardtrain verify --cpu --layouts 2 tests/cli/scripts/rank_seed.py
"""

import os

import torch
from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments

args = TrainingArguments(output_dir="out/rank_seed", per_device_train_batch_size=8, max_steps=3,
                         learning_rate=1e-2, report_to="none", save_strategy="no")
trainer = Trainer(tiny_llama(attention_dropout=0.1), args, train_dataset=variable_length_dataset(n=64))
torch.manual_seed(1000 + int(os.environ.get("RANK", 0)))  # the bug: "a different seed on every rank"
trainer.train()
