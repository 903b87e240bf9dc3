"""`fsdp_config` "layout": "auto" choosing a pipeline: a tiny Llama (tied embeddings, padded samples) on 2 ranks,
under a per-rank budget that only a pipeline candidate fits; the run takes pp 2 x dp 1 with twice the accumulation
steps, and trains the default layout's (dp 2) losses.

torchrun --nproc_per_node 2 auto_pipeline.py OUT_DIR BUDGET
BUDGET: `max_memory_per_rank` (the test takes a pipeline candidate's predicted peak from `candidates(2)`, what the
run's rank 0 traces). Rank 0 writes OUT_DIR/result.json: the choice, what the run applied (pp, accumulation,
global batch), and both runs' losses.
"""

import json
import os
import sys
from pathlib import Path

from tiny_models import tiny_llama, variable_length_dataset

from shardtrain import Trainer, TrainingArguments

# the sharding and activation checkpointing set: the candidates are this layout with and without a pipeline (two
# traces rather than twenty)
BASE = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True,
        "activation_checkpointing": False}


def arguments(out: Path, fsdp_config: dict) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, fsdp=True,
                             fsdp_config=fsdp_config, seed=7)


def model():
    return tiny_llama(seed=0, tie=True, layers=4)


def candidates(world_size: int, out: Path) -> list:
    """The candidates the run's rank 0 traces (fake tensors, no process group)."""
    from shardtrain.config.run_spec import RunSpec
    from shardtrain.plan.candidates import request_for, trace_candidates

    probe = arguments(out, {**BASE, "layout": "auto"})
    spec = RunSpec.resolve(probe, environ={**os.environ, "WORLD_SIZE": str(world_size)})
    request = request_for(spec, probe, variable_length_dataset(64), "cpu", can_pipeline=True)
    return trace_candidates(model(), spec.fsdp, request)[0]


def main() -> None:
    out, budget = Path(sys.argv[1]), int(sys.argv[2])
    data = variable_length_dataset(64)
    auto = Trainer(model(), arguments(out / "auto", {**BASE, "layout": "auto", "max_memory_per_rank": budget}),
                   train_dataset=data)
    auto.train()
    default = Trainer(model(), arguments(out / "default", BASE), train_dataset=data)
    default.train()
    if auto.rank == 0:
        data_auto, plan_auto = auto.training_plan()
        data_default, plan_default = default.training_plan()
        out.joinpath("result.json").write_text(json.dumps({
            "choice": auto.auto_layout.choice.to_dict(), "layout": auto.dims.describe(), "pp": auto.dims.pp,
            "accumulation_factor": auto.spec.accumulation_factor,
            "accumulation": [data_auto.accumulation_steps, data_default.accumulation_steps],
            "global_batch": [plan_auto.global_batch_size, plan_default.global_batch_size],
            "losses": [h["loss"] for h in auto.state.log_history if "loss" in h],
            "default_losses": [h["loss"] for h in default.state.log_history if "loss" in h]}))


if __name__ == "__main__":
    main()
