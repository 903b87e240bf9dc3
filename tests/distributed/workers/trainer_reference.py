"""The Trainer's optimizer steps against a hand-written reference loop, in one plain process.

python trainer_reference.py OUT.json
The reference: mean token cross entropy over the global batch (labels shifted, padding ignored), summed over
the micro-batches before dividing, `clip_grad_norm_`, AdamW with Hugging Face's decay grouping (no decay on
biases and norm weights: transformers' own `get_decay_parameter_names`), constant lr.
The Trainer runs with FSDP off and on (one rank), with its default fused AdamW and with optim="adamw_torch".
Writes the largest weight difference and the grad norms.
"""

import copy
import json
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed
from shardtrain.train.data.batch_plan import BatchPlan, PaddingCollator

STEPS, BATCH, ACCUM, LR, DECAY, CLIP = 3, 4, 2, 1e-2, 0.1, 0.5


def reference(model: torch.nn.Module, data: list) -> tuple[torch.nn.Module, list[float]]:
    names = set(transformers.Trainer.get_decay_parameter_names(None, model))
    decay = [p for n, p in model.named_parameters() if n in names]
    no_decay = [p for n, p in model.named_parameters() if n not in names]
    assert decay and no_decay
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR)
    plan = BatchPlan(num_samples=len(data), per_device_batch_size=BATCH, accumulation_steps=ACCUM, dp_size=1,
                     dp_rank=0, seed=42)
    collate, norms = PaddingCollator(pad_token_id=0), []
    for step in range(STEPS):
        batches = [collate([data[i] for i in idx]) for idx in plan.micro_batches(plan.permutation(0), step)]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b["labels"][:, 1:].reshape(-1),
                                   ignore_index=-100, reduction="sum") / tokens
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return model, norms


class GradNorms(TrainerCallback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "grad_norm" in logs:
            self.norms.append(logs["grad_norm"])


def main() -> None:
    data = variable_length_dataset(n=STEPS * BATCH * ACCUM)
    model = tiny_llama()
    ref_model, ref_norms = reference(copy.deepcopy(model), data)
    out = {"reference_grad_norms": ref_norms}
    for fsdp, optim in ((False, "adamw_torch_fused"), (True, "adamw_torch_fused"), (True, "adamw_torch")):
        norms = GradNorms()
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH,
                                 gradient_accumulation_steps=ACCUM, learning_rate=LR, weight_decay=DECAY,
                                 max_grad_norm=CLIP, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                                 save_strategy="no", report_to="none", disable_tqdm=True, fsdp=fsdp, optim=optim)
        trainer = Trainer(copy.deepcopy(model), args, train_dataset=data, callbacks=[norms])
        trainer.train()
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
        diff = max(float((state[k] - v).abs().max()) for k, v in ref_model.state_dict().items())
        moved = max(float((state[k] - v).abs().max()) for k, v in model.state_dict().items())
        out[f"fsdp={fsdp},{optim}"] = {"max_weight_diff": diff, "max_weight_change": moved, "grad_norms": norms.norms,
                                       "fused": bool(trainer.optimizer.defaults["fused"])}
    with open(sys.argv[1], "w") as handle:
        json.dump(out, handle)
    destroy_distributed()


if __name__ == "__main__":
    main()
