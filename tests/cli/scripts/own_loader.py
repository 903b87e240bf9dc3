"""A get_train_dataloader of the script's own whose sampler does not split the data over the ranks (the
DistributedSampler / set_epoch step forgotten): every rank reads the same batches.

    shardtrain verify --cpu --layouts 2 tests/cli/scripts/own_loader.py
"""

from tiny_models import tiny_llama, variable_length_dataset
from torch.utils.data import DataLoader

from shardtrain import Trainer, TrainingArguments


class OwnLoaderTrainer(Trainer):
    def get_train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size, shuffle=False,
                          collate_fn=self.data_collator)  # the bug: no sampler by rank


args = TrainingArguments(output_dir="out/own_loader", per_device_train_batch_size=8, max_steps=3,
                         learning_rate=1e-2, report_to="none", save_strategy="no")
OwnLoaderTrainer(tiny_llama(), args, train_dataset=variable_length_dataset(n=64)).train()
