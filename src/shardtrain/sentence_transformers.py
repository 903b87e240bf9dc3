"""sentence-transformers' trainer on shardtrain's FSDP2 engine (`pip install 'shardtrain[sentence-transformers]'`).

    from sentence_transformers import SentenceTransformer, losses
    from shardtrain.sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    args = SentenceTransformerTrainingArguments("out", fsdp=True, per_device_train_batch_size=16, max_steps=100)
    SentenceTransformerTrainer(model, args, train_dataset=pairs, loss=losses.CosineSimilarityLoss(model)).train()

Its collator, loss modules (their parameters are trained too), batch samplers' order and model card are
sentence-transformers'; the loop, sharding and checkpoints are shardtrain's. It builds its own dataloaders, so
`remove_unused_columns` does not drop the text columns its collator tokenizes.
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

__all__ = ["SentenceTransformerTrainer", "SentenceTransformerTrainingArguments"]
