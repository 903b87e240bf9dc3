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
from tiny_models import word_llama, word_tokenizer, words

CASE, OUT = sys.argv[1], Path(sys.argv[2])


rng = random.Random(0)
rows = [{"prompt": words(rng, 2, 6) + " ", "completion": words(rng, 2, 8)} for _ in range(64)]
if CASE.startswith("trl"):
    trainer_cls, config_cls, extra = trl.SFTTrainer, trl.SFTConfig, {}
else:
    import shardtrain.trl

    trainer_cls, config_cls = shardtrain.trl.SFTTrainer, shardtrain.trl.SFTConfig
    extra = {"fsdp": True} if "fsdp" in CASE else {}
model = word_llama()
args = config_cls(output_dir=str(OUT / CASE), max_steps=8, per_device_train_batch_size=8, report_to="none",
                  logging_steps=1, save_strategy="no", learning_rate=1e-2, lr_scheduler_type="constant", seed=0,
                  disable_tqdm=True, use_cpu=True, bf16=CASE != "trl_fp32", **extra)
trainer = trainer_cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                      processing_class=word_tokenizer())
trainer.train()
(OUT / f"{CASE}.json").write_text(json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]))
