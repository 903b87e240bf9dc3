"""transformers' `Seq2SeqTrainer` and `Seq2SeqTrainingArguments` on shardtrain's FSDP2 engine.

    from shardtrain import Seq2SeqTrainer, Seq2SeqTrainingArguments
    args = Seq2SeqTrainingArguments("out", fsdp=True, predict_with_generate=True, generation_num_beams=4)
    Seq2SeqTrainer(model, args, train_dataset=ds, eval_dataset=ev, data_collator=DataCollatorForSeq2Seq(tok)).train()

Hugging Face's generation in `prediction_step` (`evaluate(max_length=..., num_beams=...)`, `predict(...)`, the
`generation_*` arguments), under FSDP2 with ranks that finish generating apart (`synced_gpus`, which transformers
turns on for FSDP-managed modules).
"""

from __future__ import annotations

import transformers

from shardtrain.train.compose import arguments_on_engine, on_engine

Seq2SeqTrainer = on_engine(transformers.Seq2SeqTrainer)
Seq2SeqTrainingArguments = arguments_on_engine(transformers.Seq2SeqTrainingArguments)

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments"]
