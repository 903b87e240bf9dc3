"""A tiny T5 and a tiny BART trained and evaluated with generation by transformers' `Seq2SeqTrainer` ("hf", one
process) or by `shardtrain.Seq2SeqTrainer` ("ours", any number of ranks), each with `DataCollatorForSeq2Seq` and
the tokenizer, and with the default collator (no collator, no tokenizer: equal-length samples).

    python seq2seq.py hf OUT
    torchrun --nproc_per_node 2 seq2seq.py ours OUT

Global batch 8, 3 steps; evaluation and prediction in batches of 2 per rank (the same batches as one process in
batches of 2), `predict_with_generate` with 2 beams. Writes OUT/<case>.json: per-step losses, eval loss, the
generated tokens of `predict`, and those of `predict(max_length=3, num_beams=1)`; cases t5, t5_default, bart,
bart_default.
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)

MODE, OUT = sys.argv[1], Path(sys.argv[2])
WORLD, RANK = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(3, 60)} | {"<pad>": 0, "</s>": 1, "<unk>": 2}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def data(n: int, seed: int, fixed: bool = False) -> list[dict]:
    """Reverse the first four tokens: sources of 3 to 7 tokens (`fixed`: 6), targets of up to 4 (+ EOS)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = 6 if fixed else int(torch.randint(3, 8, (1,), generator=gen))
        source = torch.randint(3, 60, (length,), generator=gen).tolist()
        out.append({"input_ids": source + [1], "labels": list(reversed(source))[:4] + [1]})
    return out


def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                               eos_token_id=1, dropout_rate=0.0))


def bart() -> BartForConditionalGeneration:
    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


# case -> (model, with DataCollatorForSeq2Seq and the tokenizer; else the default collator on equal lengths)
CASES = {"t5": (t5, True), "t5_default": (t5, False), "bart": (bart, True), "bart_default": (bart, False)}


def run(name: str) -> dict:
    build, seq2seq_collator = CASES[name]
    common = dict(per_device_train_batch_size=8 // WORLD, per_device_eval_batch_size=2, max_steps=3,
                  learning_rate=1e-2, logging_steps=1, report_to="none", seed=0, save_strategy="no",
                  lr_scheduler_type="constant", disable_tqdm=True, predict_with_generate=True,
                  generation_max_length=6, generation_num_beams=2)
    fixed = not seq2seq_collator
    train, evaluation, model, tok = data(16, 0, fixed), data(8, 1, fixed), build(), tokenizer()
    if MODE == "hf":
        args = transformers.Seq2SeqTrainingArguments(output_dir=str(OUT / name), use_cpu=True, **common)
        trainer_cls = transformers.Seq2SeqTrainer
    else:
        import shardtrain

        args = shardtrain.Seq2SeqTrainingArguments(output_dir=str(OUT / name), fsdp=True, **common)
        trainer_cls = shardtrain.Seq2SeqTrainer
    given = dict(data_collator=DataCollatorForSeq2Seq(tok, model=model), processing_class=tok) \
        if seq2seq_collator else {}
    trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=evaluation, **given)
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h],
            "eval_loss": trainer.evaluate()["eval_loss"],
            "short": trainer.predict(evaluation, max_length=3, num_beams=1).predictions.tolist(),
            "generated": trainer.predict(evaluation).predictions.tolist()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        result = run(name)
        if RANK == 0:
            (OUT / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
