"""The usual script: a collator holding the tokenizer, no processing_class; train, save, then reload model and
tokenizer with `Auto*.from_pretrained` from the output directory, unchanged after the import switch.

    python tokenizer_pipeline.py hf|ours OUT          (ours also under torchrun: FSDP on every rank)

Writes OUT/result.json: the files of checkpoint-2 and of final/, and what the reloaded tokenizer and model give.
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast)

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<unk>": 62}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if which == "hf":
        trainer_cls, args_cls, extra = transformers.Trainer, transformers.TrainingArguments, {"use_cpu": True}
    else:
        import shardtrain

        trainer_cls, args_cls, extra = shardtrain.Trainer, shardtrain.TrainingArguments, {}
    tok = tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=60,
                                         eos_token_id=61))
    texts = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(3 + i % 5)) for i in range(16)]
    data = [tok(text) for text in texts]
    args = args_cls(output_dir=str(out), per_device_train_batch_size=4 // world, max_steps=2, save_steps=2,
                    report_to=[], disable_tqdm=True, **extra)
    trainer = trainer_cls(model=model, args=args, train_dataset=data,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    trainer.save_model(str(out / "final"))
    if int(os.environ.get("RANK", "0")) != 0:
        return
    result = {}
    for name in ("checkpoint-2", "final"):
        where = out / name
        again = AutoTokenizer.from_pretrained(where)
        reloaded = AutoModelForCausalLM.from_pretrained(where)
        ids = again("w1 w2 w3")["input_ids"]
        result[name] = {"files": sorted(p.name for p in where.iterdir() if p.name.startswith(("tokenizer", "chat",
                                                                                               "special", "generation"))),
                        "ids": ids, "chat": again.apply_chat_template([{"role": "user", "content": "w4"}],
                                                                      tokenize=False),
                        "logits_sum": float(reloaded(torch.tensor([ids])).logits.sum())}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
