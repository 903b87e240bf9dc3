"""The mistake `shardtrain verify` exists to catch: a compute_loss that returns the mean over its own micro-batch.

    shardtrain verify --cpu --layouts 2 tests/cli/scripts/per_device_mean.py

With padding, each rank's micro-batch holds a different number of target tokens, so the mean of the ranks'
means is not the mean over the global batch (Hugging Face's `num_items_in_batch` is what fixes it).
"""

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments


class PerDeviceMeanTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss  # a mean over this micro-batch only


args = TrainingArguments(output_dir="out/per_device_mean", per_device_train_batch_size=8, max_steps=4,
                         learning_rate=1e-2, report_to="none", save_strategy="no")
PerDeviceMeanTrainer(tiny_llama(), args, train_dataset=variable_length_dataset(n=64)).train()
