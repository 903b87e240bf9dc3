"""TRL's SFT with bf16 on one CPU process, by TRL itself and by `shardtrain.trl` (with and without FSDP2), on the
same data and model: the per-step losses, to compare what bf16 means in each.

    python trl_bf16.py trl_fp32|trl_bf16|ours_bf16|ours_fsdp_bf16 OUT      -> OUT/<case>.json
"""

import json
import random
import sys
from pathlib import Path

import datasets
import trl
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CASE, OUT = sys.argv[1], Path(sys.argv[2])


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<unk>": 62}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(low, high)))


rng = random.Random(0)
rows = [{"prompt": text(rng, 2, 6) + " ", "completion": text(rng, 2, 8)} for _ in range(64)]
if CASE.startswith("trl"):
    trainer_cls, config_cls, extra = trl.SFTTrainer, trl.SFTConfig, {}
else:
    import shardtrain.trl

    trainer_cls, config_cls = shardtrain.trl.SFTTrainer, shardtrain.trl.SFTConfig
    extra = {"fsdp": True} if "fsdp" in CASE else {}
import torch  # noqa: E402

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=60, eos_token_id=61))
args = config_cls(output_dir=str(OUT / CASE), max_steps=8, per_device_train_batch_size=8, report_to="none",
                  logging_steps=1, save_strategy="no", learning_rate=1e-2, lr_scheduler_type="constant", seed=0,
                  disable_tqdm=True, use_cpu=True, bf16=CASE != "trl_fp32", **extra)
trainer = trainer_cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                      processing_class=tokenizer())
trainer.train()
(OUT / f"{CASE}.json").write_text(json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]))
