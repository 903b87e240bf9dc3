"""Training on streams: a torch `IterableDataset` and a `datasets` streaming dataset of 20 variable-length samples,
6 steps of global batch 8 (two passes, each ending on a short step of 4): a tiny Llama (compared with
transformers' Trainer) and GPT-2 with dropout and tied embeddings (resume).

    python streaming.py hf OUT                    # transformers.Trainer, one process (no dropout)
    python streaming.py ours OUT                  # shardtrain, one process
    torchrun --nproc_per_node 2 streaming.py ours OUT

Writes OUT/<case>.json: per-step losses, and for the plain cases predict() on a 13-sample torch stream and
`datasets` stream (ours also on the same samples as a list); for ours with dropout also whether a resume from
checkpoint-2 (inside the first pass) and from checkpoint-4 (inside the second) gives the losses and the bit-
identical final weights of the uninterrupted run.
"""

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from tiny_models import tiny_gpt2, tiny_llama, variable_length_dataset
from torch.utils.data import IterableDataset

MODE, OUT = sys.argv[1], Path(sys.argv[2])
WORLD, RANK = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
SAMPLES = variable_length_dataset(20)


class Stream(IterableDataset):
    def __init__(self, samples: list[dict] = SAMPLES) -> None:
        self.samples = samples

    def __iter__(self):
        yield from ({"input_ids": list(s["input_ids"])} for s in self.samples)


def hf_stream(samples: list[dict] = SAMPLES) -> datasets.IterableDataset:
    return datasets.Dataset.from_list(samples).to_iterable_dataset(num_shards=2)


def predicted(trainer, stream) -> dict:
    """predict() on a stream of 13 samples (batches of 4; on 2 ranks a short last step): labels, and per row the
    argmax tokens and the logit sum at its labelled positions."""
    out = trainer.predict(stream)
    labels, logits = torch.as_tensor(out.label_ids), torch.as_tensor(out.predictions)
    keep = labels != -100
    return {"labels": labels.tolist(), "argmax": [row[k].tolist() for row, k in zip(logits.argmax(-1), keep)],
            "logit_sums": [float(row[k].sum()) for row, k in zip(logits, keep)], "loss": out.metrics["test_loss"]}


def collate(items: list[dict]) -> dict[str, torch.Tensor]:

    longest = max(len(i["input_ids"]) for i in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n] = torch.tensor(item["input_ids"])
        labels[row, :n] = torch.tensor(item.get("labels", item["input_ids"]))
    return {"input_ids": ids, "attention_mask": (labels != -100) | (ids != 0), "labels": labels}


def run(name: str, dataset, dropout: float | None, resume: str | None = None, **extra) -> dict:
    # transformers 5.24 counts a config-built GPT-2's labels unshifted (its loss_type resolves to None), so the
    # comparison with it uses Llama
    model = tiny_llama() if dropout is None else tiny_gpt2(dropout=dropout)
    per_device, accumulation = (8, 1) if MODE == "hf" else (8 // WORLD // 2, 2)
    common = dict(output_dir=str(OUT / name), per_device_train_batch_size=per_device, max_steps=6,
                  gradient_accumulation_steps=accumulation, learning_rate=1e-2, lr_scheduler_type="constant",
                  logging_steps=1, report_to="none", disable_tqdm=True, seed=0, save_strategy="steps",
                  save_steps=2, per_device_eval_batch_size=4, **extra)
    if MODE == "hf":
        import transformers

        args = transformers.TrainingArguments(use_cpu=True, save_strategy="no", **{
            k: v for k, v in common.items() if k not in ("save_strategy", "save_steps")})
        trainer = transformers.Trainer(model, args, train_dataset=dataset, data_collator=collate)
    else:
        import shardtrain

        args = shardtrain.TrainingArguments(fsdp=True, **common)
        trainer = shardtrain.Trainer(model, args, train_dataset=dataset, data_collator=collate)
    trainer.train(resume_from_checkpoint=resume)
    result = {}
    if dropout is None:  # evaluation on streams: a torch one and a datasets one, and the same samples as a list
        result = {"predict_torch": predicted(trainer, Stream(SAMPLES[:13])),
                  "predict_datasets": predicted(trainer, hf_stream(SAMPLES[:13]))}
        if MODE == "ours":
            result["predict_list"] = predicted(trainer, [dict(s) for s in SAMPLES[:13]])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    weights = None
    if MODE == "ours":
        from shardtrain.parallel.states import full_model_state

        weights = full_model_state(trainer.model)
    position = [trainer.state.data_epoch, trainer.state.data_step] if MODE == "ours" else None
    return {"losses": losses, "weights": weights, "position": position, **result}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for kind, make in (("torch", Stream), ("datasets", hf_stream)):
        results[f"{kind}_plain"] = run(f"{kind}_plain", make(), dropout=None)
        if MODE == "ours":
            full = run(f"{kind}_dropout", make(), dropout=0.1)
            checks = {}
            for step in (2, 4):
                resumed = run(f"{kind}_resumed{step}", make(), dropout=0.1,
                              resume=str(OUT / f"{kind}_dropout" / f"checkpoint-{step}"))
                same = resumed["losses"][step:] == full["losses"][step:] and all(
                    torch.equal(resumed["weights"][k], full["weights"][k]) for k in full["weights"])
                checks[str(step)] = same
                if not same and RANK == 0:
                    print("RESUME", step, resumed["losses"], full["losses"][step:], flush=True)
            results[f"{kind}_dropout"] = {"losses": full["losses"], "resume_identical": checks,
                                          "position": full["position"]}
    if RANK == 0:
        for name, result in results.items():
            result.pop("weights", None)
            (OUT / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
