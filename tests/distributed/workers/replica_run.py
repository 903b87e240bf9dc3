"""One replica group's run of a tiny Llama (fault_tolerance from the job JSON); what it did goes to OUT/group<I>.

torchrun --nproc_per_node 2 replica_run.py '{"out": "OUT", "fault_tolerance": {...}, "max_steps": 8}'
Keys besides TrainingArguments fields: "out", "model" (llama | llama_tied | llama_dropout), "dataset_size",
"group" (this group's id), "step_sleep" (seconds each step waits after it ends), "hold" (a path: after each step
the group waits while that file exists, so a test can keep it from finishing while another group restarts;
"hold_from": only from that step on), "resume".
On train begin (the group has joined: its manager heartbeats) OUT/group<I>.started appears.
Every group's rank 0 writes OUT/group<I>/result.json (the losses it logged, its final step, a hash of its model and
optimizer state at each step's begin and end, the lost slots still waiting) and weights.pt (the final whole model,
gathered in the group).
"""

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainerCallback, TrainingArguments
from shardtrain.parallel.states import full_model_state


def fingerprint(model, optimizer) -> str:
    """A hash of this rank's model and optimizer state (bitwise: equal hashes, equal states)."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    tensors = [*model.state_dict().values()]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        digest.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class Losses(TrainerCallback):
    """Every committed step's (step, loss, grad norm), from the logs each group keeps in its state; the state's
    hash at each step's begin (after a recovery) and end."""

    def __init__(self, sleep: float, hold: str | None, hold_from: int, started: Path) -> None:
        self.sleep, self.hold, self.hold_from, self.started, self.steps = sleep, hold, hold_from, started, []
        self.hashes = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.started.touch()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append([state.global_step, logs["loss"], logs["grad_norm"]])

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.hashes[f"begin{state.global_step + 1}"] = fingerprint(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.hashes[f"end{state.global_step}"] = fingerprint(model, optimizer)
        time.sleep(self.sleep)
        while self.hold and state.global_step >= self.hold_from and Path(self.hold).exists():
            time.sleep(0.05)


def main(job: dict) -> None:
    out = Path(job.pop("out"))
    name = job.pop("model", "llama")
    model = tiny_llama(seed=0, tie=name != "llama", layers=4 if name == "llama_dropout" else 2,
                       attention_dropout=0.1 if name == "llama_dropout" else 0.0)
    data = variable_length_dataset(n=job.pop("dataset_size", 96), vocab=64)
    group = job.pop("group")  # (the launcher's --replica_group_id, or fault_tolerance's replica_group)
    losses = Losses(job.pop("step_sleep", 0.0), job.pop("hold", None), job.pop("hold_from", 0),
                    out / f"group{group}.started")
    resume = job.pop("resume", None)
    defaults = {"learning_rate": 1e-2, "weight_decay": 0.1, "max_steps": 8, "logging_steps": 1, "fsdp": True,
                "save_strategy": "no", "warmup_steps": 2, "disable_tqdm": True, "max_grad_norm": 1.0}
    args = TrainingArguments(output_dir=str(out), **{**defaults, **job})
    trainer = Trainer(model, args, train_dataset=data, callbacks=[losses])
    trainer.train(resume_from_checkpoint=resume)
    weights = full_model_state(trainer.model)
    if trainer.rank == 0:
        mine = out / f"group{group}"
        mine.mkdir(parents=True, exist_ok=True)
        torch.save(weights, mine / "weights.pt")
        (mine / "result.json").write_text(json.dumps({"steps": losses.steps, "global_step": trainer.state.global_step,
                                                      "hashes": losses.hashes,
                                                      "lost_slots": trainer.state.lost_slots}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
