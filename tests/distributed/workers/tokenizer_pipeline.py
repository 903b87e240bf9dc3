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
from tiny_models import word_llama, word_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if which == "hf":
        trainer_cls, args_cls, extra = transformers.Trainer, transformers.TrainingArguments, {"use_cpu": True}
    else:
        import shardtrain

        trainer_cls, args_cls, extra = shardtrain.Trainer, shardtrain.TrainingArguments, {}
    tok = word_tokenizer(TEMPLATE)
    model = word_llama()
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
        beside = ("tokenizer", "chat", "special", "generation")
        result[name] = {"files": sorted(p.name for p in where.iterdir() if p.name.startswith(beside)),
                        "ids": ids, "chat": again.apply_chat_template([{"role": "user", "content": "w4"}],
                                                                      tokenize=False),
                        "logits_sum": float(reloaded(torch.tensor([ids])).logits.sum())}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
