"""sentence-transformers' trainers on shardtrain's FSDP2 engine (`pip install 'shardtrain[sentence-transformers]'`).

    from sentence_transformers import SentenceTransformer, losses
    from shardtrain.sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    args = SentenceTransformerTrainingArguments("out", fsdp=True, per_device_train_batch_size=16, max_steps=100)
    SentenceTransformerTrainer(model, args, train_dataset=pairs, loss=losses.CosineSimilarityLoss(model)).train()
    # torchrun --nproc_per_node 8 script.py   (or shardtrain launch script.py)

Every trainer sentence-transformers ships, each with its arguments class: SentenceTransformer, CrossEncoder,
SparseEncoder and MultiVectorEncoder. Their collators, loss modules (whose parameters are trained too), batch
samplers' order, evaluators and model cards are sentence-transformers'; the loop, sharding and checkpoints are
shardtrain's. They build their own dataloaders, so `remove_unused_columns` does not drop the text columns their
collators tokenize. A loss with in-batch negatives sees the other ranks' candidates when it asks to gather across
devices (`gather_across_devices=True`), as under sentence-transformers; otherwise each rank's are its own.
"""

from __future__ import annotations

try:
    import sentence_transformers as _st
except ImportError as err:  # an optional extra
    raise ImportError("shardtrain.sentence_transformers needs sentence-transformers, an optional extra: "
                      "pip install 'shardtrain[sentence-transformers]'") from err

from shardtrain.train.compose import arguments_on_engine, on_engine

SentenceTransformerTrainer = on_engine(_st.SentenceTransformerTrainer)
SentenceTransformerTrainingArguments = arguments_on_engine(_st.SentenceTransformerTrainingArguments)
CrossEncoderTrainer = on_engine(_st.CrossEncoderTrainer)
CrossEncoderTrainingArguments = arguments_on_engine(_st.CrossEncoderTrainingArguments)
SparseEncoderTrainer = on_engine(_st.SparseEncoderTrainer)
SparseEncoderTrainingArguments = arguments_on_engine(_st.SparseEncoderTrainingArguments)
MultiVectorEncoderTrainer = on_engine(_st.MultiVectorEncoderTrainer)
MultiVectorEncoderTrainingArguments = arguments_on_engine(_st.MultiVectorEncoderTrainingArguments)

__all__ = ["CrossEncoderTrainer", "CrossEncoderTrainingArguments", "MultiVectorEncoderTrainer",
           "MultiVectorEncoderTrainingArguments", "SentenceTransformerTrainer", "SentenceTransformerTrainingArguments",
           "SparseEncoderTrainer", "SparseEncoderTrainingArguments"]
