"""One process tries resumes that must fail clearly; writes {case: error message} to OUT.json.

python bad_resumes.py OUT.json CHECKPOINT_DIR(sharded, tiny llama) FULL_CHECKPOINT_DIR
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import CheckpointError, Trainer, TrainingArguments, destroy_distributed


def attempt(model, checkpoint: Path, fsdp: bool = True) -> str:
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=10, per_device_train_batch_size=8, fsdp=fsdp,
                             save_strategy="no", disable_tqdm=True, report_to="none")
    try:
        Trainer(model, args, train_dataset=variable_length_dataset()).train(resume_from_checkpoint=str(checkpoint))
    except CheckpointError as err:
        return str(err)
    return "NO ERROR"


def main() -> None:
    out, sharded, full = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    scratch = Path(tempfile.mkdtemp())
    results = {
        "wider_model": attempt(tiny_llama(hidden=48), sharded),
        "deeper_model": attempt(tiny_llama(layers=3), full),
        "fsdp_off": attempt(tiny_llama(), sharded, fsdp=False),
    }
    truncated = scratch / "truncated"
    shutil.copytree(sharded, truncated)
    shard = truncated / "sharded" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    results["truncated_shard"] = attempt(tiny_llama(), truncated)
    broken = scratch / "broken_full"
    shutil.copytree(full, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    results["truncated_safetensors"] = attempt(tiny_llama(), broken)
    results["not_a_checkpoint"] = attempt(tiny_llama(), scratch)
    Path(out).write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
