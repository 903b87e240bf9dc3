"""A Trainer run under a pipeline against a one-process reference of the same global batches.

torchrun --nproc_per_node N pipeline_run.py OUT_DIR PP SCHEDULE MICROBATCHES TIE [DP_SHARD [TP]]
Tiny Llama (4 layers; TIE "1": tied input/output embeddings), padded samples of different lengths (so the
microbatches hold different numbers of target tokens), 2 accumulation steps, AdamW with weight decay, clipping
at 0.5 (it clips). The reference, in each rank's own process: the unsplit model, the mean token cross entropy over
each step's global batch (every data-parallel rank's micro-batches), `clip_grad_norm_`, AdamW. Each rank writes
OUT_DIR/rank<R>.json: the logged losses and grad norms, the reference's, and the largest difference between its
stage's weights and the reference's (tied embeddings: both copies against the one tied weight).
"""

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed
from shardtrain.plan.pipeline_estimate import bubble_fraction, idle_shares
from shardtrain.train.data.batch_plan import BatchPlan, PaddingCollator

STEPS, BATCH, ACCUM, LR, DECAY, CLIP = 3, 4, 2, 1e-3, 0.1, 0.5


def reference(model: torch.nn.Module, data: list, dp: int) -> tuple[torch.nn.Module, list[float], list[float]]:
    names = set(transformers.Trainer.get_decay_parameter_names(None, model))
    params = dict(model.named_parameters())  # (tied: one entry)
    opt = torch.optim.AdamW([{"params": [p for n, p in params.items() if n in names], "weight_decay": DECAY},
                             {"params": [p for n, p in params.items() if n not in names], "weight_decay": 0.0}],
                            lr=LR)
    plans = [BatchPlan(num_samples=len(data), per_device_batch_size=BATCH, accumulation_steps=ACCUM, dp_size=dp,
                       dp_rank=r, seed=42) for r in range(dp)]
    collate, losses, norms = PaddingCollator(pad_token_id=0), [], []
    for step in range(STEPS):
        batches = [collate([data[i] for i in idx]) for plan in plans
                   for idx in plan.micro_batches(plan.permutation(0), step)]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b["labels"][:, 1:].reshape(-1),
                                   ignore_index=-100, reduction="sum") / tokens
            loss.backward()
            total += float(loss)
        losses.append(total)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return model, losses, norms


class Logged(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "grad_norm" in logs:
            self.losses.append(logs["loss"])
            self.norms.append(logs["grad_norm"])


def main() -> None:
    out_dir, pp, schedule, microbatches, tie = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
        sys.argv[5] == "1"
    dp_shard = int(sys.argv[6]) if len(sys.argv) > 6 else None
    tp = int(sys.argv[7]) if len(sys.argv) > 7 else None
    model = tiny_llama(tie=tie, layers=4)
    logged = Logged()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, learning_rate=LR, weight_decay=DECAY,
                             max_grad_norm=CLIP, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                             save_strategy="no", report_to="none", disable_tqdm=True, fsdp=True, pp_size=pp,
                             pp_schedule=schedule, pp_microbatches=microbatches,
                             parallelism_config={"dp_shard_size": dp_shard, "tp_size": tp} if dp_shard else None)
    data = variable_length_dataset(n=64)
    trainer = Trainer(copy.deepcopy(model), args, train_dataset=data, callbacks=[logged])
    trainer.train()
    dp = trainer.dims.batch_size
    ref_model, ref_losses, ref_norms = reference(copy.deepcopy(model), data, dp)
    ref_state = ref_model.state_dict()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
    diffs = {k: float((v - ref_state[k]).abs().max()) for k, v in state.items()}
    moved = max(float((v - model.state_dict()[k]).abs().max()) for k, v in state.items())
    rank = dist.get_rank()
    result = {"losses": logged.losses, "grad_norms": logged.norms, "reference_losses": ref_losses,
              "reference_grad_norms": ref_norms, "max_weight_diff": max(diffs.values()), "max_weight_change": moved,
              "keys": sorted(state), "stage": trainer.pipeline.split.stage, "layout": trainer.dims.describe(),
              "bubble": bubble_fraction(schedule, stages=pp, microbatches=microbatches)}
    if len(trainer.pipeline.stages) > 1:  # torch's table of a schedule of several stages per rank, played
        result["table_idle_shares"] = list(idle_shares(trainer.pipeline.schedule.pipeline_order,
                                                       stages=trainer.pipeline.split.stages).values())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
