"""Train a tiny Llama with the Trainer and write its log history; the knobs come as JSON.

torchrun --nproc_per_node 2 train_run.py OUT_DIR '{"per_device_train_batch_size": 4, "max_steps": 10}'
Special keys: "tie", "dataset_size", "resume" (passed to train()), "save_model" (dir), "world_note".
"""

import json
import sys
from pathlib import Path

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments, destroy_distributed


def main() -> None:
    out, knobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    tie = knobs.pop("tie", False)
    data = variable_length_dataset(n=knobs.pop("dataset_size", 96))
    resume = knobs.pop("resume", None)
    save_model = knobs.pop("save_model", None)
    defaults = {"learning_rate": 1e-2, "weight_decay": 0.1, "max_steps": 10, "logging_steps": 1, "fsdp": True,
                "save_strategy": "no", "warmup_steps": 2, "disable_tqdm": True, "max_grad_norm": 1.0}
    args = TrainingArguments(output_dir=str(out), **{**defaults, **knobs})
    trainer = Trainer(tiny_llama(tie=tie), args, train_dataset=data, eval_dataset=data[:20])
    state = trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    if save_model:
        trainer.save_model(save_model)
    if trainer.rank == 0:
        train_logs = [e for e in state.log_history if "loss" in e]
        (out / "result.json").write_text(json.dumps({
            "steps": [e["step"] for e in train_logs], "losses": [e["loss"] for e in train_logs],
            "grad_norms": [e["grad_norm"] for e in train_logs], "lrs": [e["learning_rate"] for e in train_logs],
            "eval_loss": metrics["eval_loss"], "global_step": state.global_step}))
    destroy_distributed()


if __name__ == "__main__":
    main()
