"""What a plain TRL script meets after the import switch, run by TRL's own trainer ("trl") and by `shardtrain.trl`'s
("ours") on one CPU process, on the same case:

    python trl_switch.py trl|ours CASE OUT        -> OUT/<side>_<case>.json

sft_save: SFT with checkpoints saved (TRL writes a model card at every save) and a dict of two eval sets;
kto_eval: KTO evaluated on a dataset, a DatasetDict-like dict and an IterableDataset; grpo_eval: GRPO evaluated
(its batches are lists of prompts, generated in its prediction_step); grpo_entropy: GRPO's adaptive entropy
coefficient under gradient accumulation; dpo_metrics / reward_metrics / kto_metrics:
compute_metrics on what the library's prediction_step returns (DPO's and KTO's logits with input_ids as labels,
the reward model's logits with no labels named), over batches that pad differently and a short last batch. Each
writes its logged entries and files (the metrics cases: what compute_metrics saw).
"""

import json
import random
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
import trl
from tiny_models import word_llama, word_tokenizer, words

SIDE, CASE, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if SIDE == "ours":
    import shardtrain.trl as lib
else:
    lib = trl


tokenizer, text, model = word_tokenizer, words, word_llama


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
    args = lib.KTOConfig(**common(max_steps=1, per_device_eval_batch_size=8))
    trainer = lib.KTOTrainer(model=model(), ref_model=model(), args=args,
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
elif CASE == "grpo_entropy":  # the adaptive entropy coefficient moves once per optimizer step (sync_gradients)
    rows = [{"prompt": text(rng, 2, 5)} for _ in range(12)]
    args = lib.GRPOConfig(**common(max_steps=3, per_device_train_batch_size=2, num_generations=2,
                                   gradient_accumulation_steps=2, max_completion_length=4, entropy_coef=0.01,
                                   use_adaptive_entropy=True, entropy_target=15.0, entropy_coef_delta=0.005))
    trainer = lib.GRPOTrainer(model=model(), reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                              args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer())
    trainer.train()
    result = {"coef": round(trainer.entropy_coef, 6), "steps": trainer.state.global_step}
elif CASE.endswith("_metrics"):
    seen: list = []

    def summary(values) -> object:
        if isinstance(values, tuple | list):
            return [summary(v) for v in values]
        array = np.asarray(values, dtype=np.float64)
        return {"shape": list(array.shape), "sum": round(float(array.sum()), 3),
                "ignored": int((array == -100).sum())}

    def metrics(prediction) -> dict:
        seen.append({"predictions": summary(prediction.predictions), "label_ids": summary(prediction.label_ids)})
        return {"my_metric": 0.5}

    pairs = [{"prompt": text(rng, 2, 5) + " ", "chosen": text(rng, 1, 6), "rejected": text(rng, 1, 6)}
             for _ in range(12)]
    if CASE == "reward_metrics":
        pairs = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in pairs]
    elif CASE == "kto_metrics":
        pairs = [{"prompt": p["prompt"], "completion": p["chosen"], "label": i % 3 != 0} for i, p in enumerate(pairs)]
    # 8 rows (two full batches of 4) and 7 (a short last batch)
    sets = {"even": datasets.Dataset.from_list(pairs[4:12]), "short": datasets.Dataset.from_list(pairs[4:11])}
    given = dict(args=dict(max_steps=1, per_device_eval_batch_size=4, per_device_train_batch_size=4),
                 train_dataset=datasets.Dataset.from_list(pairs[:4]), eval_dataset=sets, processing_class=tokenizer(),
                 compute_metrics=metrics)
    given["args"] = common(**given["args"])
    if CASE == "dpo_metrics":
        trainer = lib.DPOTrainer(model=model(), ref_model=model(), **{**given, "args": lib.DPOConfig(**given["args"])})
    elif CASE == "reward_metrics":
        from transformers import LlamaForSequenceClassification

        config = model().config.to_dict() | {"num_labels": 1}
        trainer = lib.RewardTrainer(model=LlamaForSequenceClassification(model().config.__class__(**config)),
                                    **{**given, "args": lib.RewardConfig(**given["args"])})
    else:
        trainer = lib.KTOTrainer(model=model(), ref_model=model(), **{**given, "args": lib.KTOConfig(**given["args"])})
    scores = trainer.evaluate()
    result = {name: {"metric": scores.get(f"eval_{name}_my_metric"), "seen": part}
              for name, part in zip(sets, seen, strict=True)}
(OUT / f"{SIDE}_{CASE}.json").write_text(json.dumps(result))
