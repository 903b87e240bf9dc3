"""push_to_hub with the Hub's two calls recorded instead of sent (`HfApi.create_repo`, `HfApi.upload_folder`, as
transformers' and sentence-transformers' own tests record them): a tiny Llama trained 4 steps, a checkpoint every 2,
then `save_model()`, under transformers' Trainer on one process ("hf") or shardtrain's on any number of ranks.

    python hub_push.py hf|ours STRATEGY OUT              # STRATEGY: Hugging Face's hub_strategy
    torchrun --nproc_per_node 2 hub_push.py ours STRATEGY OUT

Writes OUT/uploads.json (rank 0): the repository created, and per upload its commit message, path in the repository
and the files it would send (huggingface_hub's own filter over the folder, as it was at the call); each rank's
calls are counted in OUT/calls-<rank>.json.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects
from tiny_models import tiny_llama, token_batches

MODE, STRATEGY, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
RANK = int(os.environ.get("RANK", 0))
created: list[str] = []
uploads: list[dict] = []


def create_repo(self, repo_id, **kwargs):
    created.append(repo_id)
    return SimpleNamespace(repo_id=f"user/{repo_id}")


def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, commit_message=None, ignore_patterns=None,
                  **kwargs):
    root = Path(folder_path)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    uploads.append({"repo_id": repo_id, "folder": os.path.relpath(folder_path, OUT / "run"),
                    "path_in_repo": path_in_repo, "message": commit_message,
                    "files": sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))})
    return SimpleNamespace(done=lambda: True)


def main() -> None:
    if MODE == "hf":
        from transformers import Trainer, TrainingArguments
    else:
        from shardtrain import Trainer, TrainingArguments
    world = int(os.environ.get("WORLD_SIZE", 1))
    rows = [{"input_ids": ids.tolist(), "labels": ids.tolist()} for ids in token_batches(1, 16)[0]]
    common = dict(output_dir=str(OUT / "run"), max_steps=4, per_device_train_batch_size=4 // world,
                  save_strategy="steps", save_steps=2, push_to_hub=True, hub_model_id="tiny", hub_strategy=STRATEGY,
                  report_to="none", logging_steps=1, disable_tqdm=True)
    args = TrainingArguments(**common, use_cpu=True) if MODE == "hf" else TrainingArguments(
        **common, fsdp=True, fsdp_config={"state_dict_type": "FULL_STATE_DICT"})
    with patch.object(HfApi, "create_repo", create_repo), patch.object(HfApi, "upload_folder", upload_folder):
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=rows)
        trainer.train()
        trainer.save_model()
    (OUT).mkdir(parents=True, exist_ok=True)
    (OUT / f"calls-{RANK}.json").write_text(json.dumps({"created": len(created), "uploads": len(uploads)}))
    if RANK == 0:
        (OUT / "uploads.json").write_text(json.dumps({"created": created, "uploads": uploads}, indent=1))


if __name__ == "__main__":
    main()
