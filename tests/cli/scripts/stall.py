"""Launched by tests/cli: a Trainer run where one rank stops (SIGSTOP) or everything sleeps, for timeouts/signals.

    shardtrain launch --num_processes 2 tests/cli/scripts/stall.py OUT MODE     MODE: sigstop | sleep

sigstop: rank 1 stops itself after step 2; rank 0 must fail within ddp_timeout (10 s), not hang.
sleep: every rank writes OUT/ready-RANK and sleeps in a step callback, waiting for the test's signal.
"""

import os
import signal
import sys
import time
from pathlib import Path

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainerCallback, TrainingArguments


class Stall(TrainerCallback):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_step_end(self, args, state, control, **kwargs):
        if self.mode == "sigstop" and state.global_step == 2 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.mode == "sleep":
            (Path(args.output_dir) / f"ready-{os.environ['RANK']}").touch()
            time.sleep(300)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    args = TrainingArguments(output_dir=out, fsdp=True, max_steps=6, per_device_train_batch_size=2,
                             save_strategy="no", disable_tqdm=True, ddp_timeout=10)
    Trainer(tiny_llama(), args, train_dataset=variable_length_dataset(n=32), callbacks=[Stall(mode)]).train()


if __name__ == "__main__":
    main()
