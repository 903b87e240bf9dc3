"""A correct script that verify must pass at its default settings: AdamW at a high learning rate (it turns the
rounding of near-zero gradients into weight differences far above 1e-5), accumulation 2 in the script, dropout in
the model (verify turns it off: each rank draws its own masks). `--dropout 0` and `--accumulation 1` vary it.

    shardtrain verify --cpu --layouts 2 --accumulation 1,2 tests/cli/scripts/correct_adamw.py
"""

import sys

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments

flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
args = TrainingArguments(output_dir="out/correct_adamw", per_device_train_batch_size=4, max_steps=3,
                         gradient_accumulation_steps=int(flags.get("--accumulation", 2)), learning_rate=3e-3,
                         weight_decay=0.1, report_to="none", save_strategy="no")
model = tiny_llama(attention_dropout=float(flags.get("--dropout", 0.1)))
Trainer(model, args, train_dataset=variable_length_dataset(n=64)).train()
