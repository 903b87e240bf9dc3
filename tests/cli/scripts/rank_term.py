"""A loss normalised over the global batch, as it should be, plus a term that depends on the rank: what
`shardtrain verify` must not blame on normalisation.

    shardtrain verify --cpu --layouts 2 --accumulation 1,2 tests/cli/scripts/rank_term.py

The term is a constant per step (spread over the micro-batches), so it moves the reported loss by the same amount
with any accumulation and never reaches the gradients.
"""

import torch.distributed as dist
from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments


class RankTermTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        rank = dist.get_rank() if dist.is_initialized() else 0
        loss = loss + 0.01 * rank / self.args.gradient_accumulation_steps  # the bug: the rank in the loss
        return (loss, outputs) if return_outputs else loss


args = TrainingArguments(output_dir="out/rank_term", per_device_train_batch_size=8, max_steps=3,
                         learning_rate=1e-2, report_to="none", save_strategy="no")
RankTermTrainer(tiny_llama(), args, train_dataset=variable_length_dataset(n=64)).train()
