"""A training script with no resume logic of its own, launched with --max_restarts by tests/cli.

    shardtrain launch --max_restarts 2 --num_processes 2 tests/cli/scripts/train_restart.py OUT KIND [KILL]

Trains a tiny Llama (attention dropout on) for 8 steps, checkpointing every 2 (KIND: SHARDED_STATE_DICT or
FULL_STATE_DICT), and saves OUT/final. KILL="rank:step[:damage]" is the test's fault: on the first attempt
that rank SIGKILLs itself after that step; with a damage word, rank 0 first damages the newest checkpoint
(as a failing disk would). KILL="rank:step:term:WHEN" sends SIGTERM instead (a scheduler's preemption) at
WHEN of that step: step_begin, step_end, log or save; the Trainer checkpoints and exits 143. After torchrun
restarts the group, the Trainer resumes by itself.
"""

import os
import signal
import sys
from pathlib import Path

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainerCallback, TrainingArguments


def damage(out: Path, how: str) -> None:
    newest = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if how == "truncate":
        victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[:64])
    elif how == "rng":
        (newest / "rng_state_1.pt").unlink()
    elif how == "state":
        (newest / "trainer_state.json").write_text("{}")
    elif how == "manifest":
        (newest / "manifest.json").unlink()
    elif how == "scheduler":
        path = newest / "scheduler.json"
        path.write_text(path.read_text().replace('"_step_count": ', '"_step_count": 1'))


class Fault(TrainerCallback):
    def __init__(self, spec: str, out: Path) -> None:
        rank, step, *how = spec.split(":")
        self.rank, self.step, self.how, self.out = int(rank), int(step), how, out

    def _due(self, state, when: str) -> bool:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        wanted = self.how[1] if self.how and self.how[0] == "term" else "step_end"
        return first_attempt and wanted == when and state.global_step == self.step and \
            int(os.environ["RANK"]) == self.rank

    def _fire(self, state, when: str) -> None:
        if not self._due(state, when):
            return
        if self.how and self.how[0] == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.how:
            damage(self.out, self.how[0])
        os.kill(os.getpid(), signal.SIGKILL)

    def on_step_begin(self, args, state, control, **kwargs):
        self._fire(state, "step_begin")

    def on_step_end(self, args, state, control, **kwargs):
        self._fire(state, "step_end")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._fire(state, "log")

    def on_save(self, args, state, control, **kwargs):
        self._fire(state, "save")


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    model = tiny_llama()
    model.config.attention_dropout = 0.1
    args = TrainingArguments(output_dir=str(out), fsdp=True, max_steps=8, per_device_train_batch_size=4,
                             learning_rate=1e-2, save_strategy="steps", save_steps=2, logging_steps=1,
                             disable_tqdm=True, fsdp_config={"state_dict_type": kind})
    callbacks = [Fault(sys.argv[3], out)] if len(sys.argv) > 3 else []
    trainer = Trainer(model, args, train_dataset=variable_length_dataset(n=64), callbacks=callbacks)
    trainer.train()
    trainer.save_model(str(out / "final"))
    if trainer.rank == 0:
        print(f"layout: {trainer.dims.describe()}", flush=True)


if __name__ == "__main__":
    main()
