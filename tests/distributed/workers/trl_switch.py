"""What a plain TRL script meets after the import switch, run by TRL's own trainer ("trl") and by `shardtrain.trl`'s
("ours") on one CPU process, on the same case:

    python trl_switch.py trl|ours CASE OUT        -> OUT/<side>_<case>.json

sft_save: SFT with checkpoints saved (TRL writes a model card at every save) and a dict of two eval sets;
kto_eval: KTO evaluated on a dataset, a DatasetDict-like dict and an IterableDataset; grpo_eval: GRPO evaluated
(its batches are lists of prompts, generated in its prediction_step). Each writes its logged entries and files.
"""

import json
import random
import sys
from pathlib import Path

import datasets
import torch
import trl
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SIDE, CASE, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if SIDE == "ours":
    import shardtrain.trl as lib
else:
    lib = trl


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<unk>": 62}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(low, high)))


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=60,
                                        eos_token_id=61))


def common(**kwargs) -> dict:
    return dict(output_dir=str(OUT / f"{SIDE}_{CASE}"), report_to="none", seed=0, disable_tqdm=True, use_cpu=True,
                bf16=False, logging_steps=1, learning_rate=1e-2, **kwargs)


def evals(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
            for h in trainer.state.log_history if any(k.startswith("eval") for k in h)]


rng = random.Random(0)
result: dict = {}
if CASE == "sft_save":
    rows = [{"prompt": text(rng, 2, 6) + " ", "completion": text(rng, 2, 8)} for _ in range(40)]
    sets = {"a": datasets.Dataset.from_list(rows[32:36]), "b": datasets.Dataset.from_list(rows[36:])}
    trainer = lib.SFTTrainer(model=model(), args=lib.SFTConfig(**common(max_steps=3, save_steps=2, eval_steps=2,
                                                                        eval_strategy="steps",
                                                                        per_device_train_batch_size=4)),
                             train_dataset=datasets.Dataset.from_list(rows[:32]), eval_dataset=sets,
                             processing_class=tokenizer())
    trainer.train()
    out = Path(trainer.args.output_dir)
    result = {"evals": evals(trainer), "checkpoint": sorted(p.name for p in (out / "checkpoint-2").iterdir()),
              "card": (out / "README.md").is_file(), "group": torch.distributed.is_initialized()}
elif CASE == "kto_eval":
    rows = [{"prompt": text(rng, 2, 5) + " ", "completion": text(rng, 2, 6), "label": i % 3 != 0} for i in range(20)]
    data = datasets.Dataset.from_list(rows)
    trainer = lib.KTOTrainer(model=model(), ref_model=model(), args=lib.KTOConfig(**common(max_steps=1, per_device_eval_batch_size=8)),
                             train_dataset=data.select(range(12)), eval_dataset=data.select(range(12, 20)),
                             processing_class=tokenizer())
    for name, given in (("dataset", None), ("dict", {"x": trainer.eval_dataset}),
                        ("iterable", trainer.eval_dataset.to_iterable_dataset())):
        metrics = trainer.evaluate(given) if given is not None else trainer.evaluate()
        result[name] = {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}
elif CASE == "grpo_eval":
    rows = [{"prompt": text(rng, 2, 5)} for _ in range(8)]

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = lib.GRPOConfig(**common(max_steps=1, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                                   num_generations=2, max_completion_length=4))
    trainer = lib.GRPOTrainer(model=model(), reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_list(rows),
                              eval_dataset=datasets.Dataset.from_list(rows[:4]), processing_class=tokenizer())
    metrics = trainer.evaluate()
    result = {"keys": sorted(k for k in metrics if "runtime" not in k and "per_second" not in k)}
(OUT / f"{SIDE}_{CASE}.json").write_text(json.dumps(result))
