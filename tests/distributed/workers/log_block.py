"""What transformers' Trainer ("hf") and shardtrain's ("ours") log on the `transformers.trainer` logger with
`log_level="info"`: the "***** Running training *****" block. Writes the lines as JSON to OUT.json.

    python log_block.py hf|ours OUT.json
"""

import json
import sys

import transformers
from tiny_models import tiny_llama
from transformers.testing_utils import CaptureLogger

WHICH, OUT = sys.argv[1], sys.argv[2]


def main() -> None:
    if WHICH == "hf":
        trainer_cls, args_cls = transformers.Trainer, transformers.TrainingArguments
    else:
        import shardtrain

        trainer_cls, args_cls = shardtrain.Trainer, shardtrain.TrainingArguments
    rows = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 8
    args = args_cls(f"{OUT}.run", max_steps=1, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                    log_level="info", disable_tqdm=True, save_strategy="no")
    trainer = trainer_cls(model=tiny_llama(), args=args, train_dataset=rows)
    with CaptureLogger(transformers.utils.logging.get_logger("transformers.trainer")) as captured:
        trainer.train()
    block = [line for line in captured.out.splitlines() if line.startswith(("*****", "  "))]
    with open(OUT, "w") as f:
        json.dump({"block": block, "verbosity": transformers.utils.logging.get_verbosity()}, f)


if __name__ == "__main__":
    main()
