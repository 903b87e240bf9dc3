"""report_to = wandb, mlflow, trackio, tensorboard, comet_ml and swanlab, all offline: 3 logged steps of a tiny
Llama.

    WANDB_MODE=offline WANDB_DIR=D MLFLOW_TRACKING_URI=file:D/mlruns TRACKIO_DIR=D/trackio \
        COMET_START_ONLINE=false COMET_OFFLINE_DIRECTORY=D/comet SWANLAB_MODE=offline SWANLAB_LOG_DIR=D/swanlog \
        torchrun --nproc_per_node 2 trackers.py OUT

Writes OUT/result.json on rank 0: the per-step losses shardtrain logged (to compare with what each tracker
wrote).
"""

import json
import sys
from pathlib import Path

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments

OUT = Path(sys.argv[1])


def main() -> None:
    args = TrainingArguments(str(OUT), fsdp=True, per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                             learning_rate=1e-2,
                             report_to=["wandb", "mlflow", "trackio", "tensorboard", "comet_ml", "swanlab"],
                             save_strategy="no", disable_tqdm=True, run_name="shardtrain-trackers", project="st")
    trainer = Trainer(tiny_llama(), args, train_dataset=variable_length_dataset(16))
    trainer.train()
    if trainer.rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
        names = sorted(type(c).__name__ for c in trainer.callbacks)
        (OUT / "result.json").write_text(json.dumps({"losses": losses, "callbacks": names}))


if __name__ == "__main__":
    main()
