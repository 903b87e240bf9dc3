"""Pipeline parallelism against FSDP alone on the same model and global batch: per-rank state memory, peak RSS and
step time, and each schedule's measured idle share against its theoretical bubble.

    .venv/bin/python benchmarks/pipeline.py --out benchmarks/results/pipeline.json     # ~4 min, 2 ranks
    .venv/bin/python benchmarks/pipeline.py --microbatches 4 --steps 4 --out /tmp/pp.json   # quick
    .venv/bin/python benchmarks/pipeline.py --schedules Interleaved1F1B,InterleavedZeroBubble,ZBVZeroBubble,DualPipeV \
        --microbatches 4,8 --out benchmarks/results/pipeline_two_stages.json      # two stages per rank, ~5 min

One `python -m torch.distributed.run --nproc_per_node 2` launch of this file (`--worker`, gloo, OMP_NUM_THREADS=1
per rank) per mode, each `shardtrain.Trainer` on the same fp32 Llama (8 layers, hidden 256, vocab 2048), the same
token ids (fixed length, no padding) and the same per-rank batch of `--batch` sequences of `--seq` tokens:

  * `fsdp`: FSDP2 over both ranks (data parallel; the reference): the global batch is 2 x batch.
  * `<schedule>_m<M>`: pp 2 with M microbatches per micro-batch: GPipe or 1F1B (one stage per rank, 4 layers
    each), or a schedule of two stages per rank (2 layers each: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV); the global batch is the batch (both ranks see the same samples).

Measured per rank: the bytes of its parameters, gradients and optimizer state (local shards, at the second step),
against `plan.pipeline_estimate.stage_state_bytes` of the stage's parameters and the planner's traced state
(`shardtrain.plan(..., pp=2)`: the stage that peaks, with the microbatches it holds in flight; its tensor peak is
reported too, next to the process's peak RSS, which also holds the runtime); the process's peak RSS; the median
step time after warm-up and tokens per second (global tokens / step time). For the pipeline modes, the idle
share of the schedule: 1 - (time in the rank's stages' forward, backward and weight-gradient chunks) / (time in
`schedule.step`), each rank's, next to the schedule's bubble (`plan.pipeline_estimate.bubble_fraction`: (p - 1) /
(m + p - 1) for GPipe and 1F1B). On 2 CPU cores each
rank has one core; the point-to-point sends are gloo's over loopback.
Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def timed(function, busy: list[float]):
    """`function` that adds its wall time to busy[0]."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start
    return wrapper


def worker(cli: argparse.Namespace) -> None:
    import json
    import tempfile

    import torch
    import torch.distributed as dist
    from bench_common import grad_bytes, optimizer_state_bytes, param_bytes, peak_rss_bytes

    from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed
    from shardtrain.plan.pipeline_estimate import bubble_fraction, in_flight, stage_state_bytes

    pipelined = cli.mode != "fsdp"
    schedule, microbatches = (cli.mode.split("_m")[0], int(cli.mode.split("_m")[1])) if pipelined else (None, None)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in
            torch.randint(0, 2048, (cli.batch * 2 * (cli.steps + 1), cli.seq), generator=gen).tolist()]
    pp = {"pp_size": 2, "pp_schedule": schedule, "pp_microbatches": microbatches} if pipelined else {}
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), fsdp=True, per_device_train_batch_size=cli.batch,
                             max_steps=cli.steps, learning_rate=1e-3, save_strategy="no", report_to="none",
                             disable_tqdm=True, logging_steps=10**9, **pp)
    model = build_model()
    trainer = Trainer(model, args, train_dataset=data)
    busy, schedule_time, marks, state = [0.0], [0.0], [], {}
    pipeline = trainer.pipeline
    if pipeline is not None:  # busy: the stages' compute; schedule: the whole schedule step (compute + waiting)
        for stage in pipeline.stages:  # (a zero-bubble schedule's weight passes are chunks of their own)
            for chunk in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, chunk, timed(getattr(stage, chunk), busy))
        pipeline.schedule.step = timed(pipeline.schedule.step, schedule_time)
    per_step: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append(time.perf_counter())
            per_step.append((busy[0], schedule_time[0]))

        def on_pre_optimizer_step(self, args, trainer_state, control, model=None, optimizer=None, **k):
            if trainer_state.global_step == 1:  # the second step: AdamW's slots exist (made at the first)
                state.update(params=param_bytes(model), grads=grad_bytes(model),
                             optimizer=sum(optimizer_state_bytes(optimizer).values()))

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())
            per_step.append((busy[0], schedule_time[0]))

    trainer.add_callback(Clock())
    trainer.train()
    steps = [marks[i + 1] - marks[i] for i in range(0, len(marks), 2)][cli.warmup:]
    spans = [(per_step[i + 1][0] - per_step[i][0], per_step[i + 1][1] - per_step[i][1])
             for i in range(0, len(per_step), 2)][cli.warmup:]
    stage_params = sum(p.numel() for p in trainer.model.parameters())  # this stage's (all of it without pp)
    dp = trainer.dims.dp_shard
    mine: dict[str, Any] = {
        "rank": dist.get_rank(), "state_bytes": state, "state_bytes_total": sum(state.values()),
        "predicted_state_bytes": stage_state_bytes(stage_params, dp=dp), "peak_rss_bytes": peak_rss_bytes(),
        "step_time_s_median": statistics.median(steps)}
    if pipeline is not None:
        stage = pipeline.split.stage
        idle = [1 - b / s for b, s in spans if s > 0]
        mine.update(stage=stage, stages=list(pipeline.split.held),
                    layers=[[r.start, r.stop] for r in pipeline.split.layers],
                    idle_share_median=statistics.median(idle),
                    busy_share_of_step=statistics.median(b / t for (b, _), t in zip(spans, steps, strict=True)),
                    schedule_share_of_step=statistics.median(s / t for (_, s), t in zip(spans, steps, strict=True)),
                    in_flight_microbatches=in_flight(schedule, stages=2, microbatches=microbatches, stage=stage))
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        global_tokens = cli.batch * cli.seq * trainer.dims.batch_size
        result = {"mode": cli.mode, "layout": trainer.dims.describe(), "global_tokens_per_step": global_tokens,
                  "step_time_s_median": max(r["step_time_s_median"] for r in ranks),
                  "tokens_per_s": global_tokens / max(r["step_time_s_median"] for r in ranks), "ranks": ranks}
        if pipeline is not None:
            theory = bubble_fraction(schedule, stages=2, microbatches=microbatches)
            measured = statistics.fmean(r["idle_share_median"] for r in ranks)
            result.update(bubble_theory=theory, idle_share_measured=measured,
                          idle_vs_theory=measured / theory if theory else None)
        Path(cli.out_file).write_text(json.dumps(result))
    destroy_distributed()


def planned(mode: str, cli: argparse.Namespace) -> dict[str, Any]:
    """`shardtrain.plan` of the same run (target cpu, no step time): the traced stage's state and tensor peak."""
    import shardtrain

    pp = {}
    if mode != "fsdp":
        schedule, microbatches = mode.split("_m")
        pp = {"pp": 2, "pp_schedule": schedule, "pp_microbatches": int(microbatches)}
    result = shardtrain.plan(build_model(), world_size=2, per_device_batch=cli.batch, seq_len=cli.seq,
                             target="cpu", estimate_step_time=False, what_if=False, **pp)
    return {"state_bytes": sum(result.trace.state.values()), "tensor_peak_bytes": result.trace.peak,
            "pipeline": result.settings.get("pipeline")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--schedules", default="GPipe,1F1B")
    parser.add_argument("--microbatches", default="2,4,8", help="comma-separated pp_microbatches to measure")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out")
    cli = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if cli.worker:
        worker(cli)
        return
    from bench_common import emit, launch_self

    passed = ["--batch", str(cli.batch), "--seq", str(cli.seq), "--steps", str(cli.steps),
              "--warmup", str(cli.warmup)]
    modes = ["fsdp"] + [f"{s}_m{m}" for s in cli.schedules.split(",") for m in cli.microbatches.split(",")]
    runs = {}
    for mode in modes:
        print(f"[pipeline] {mode}", file=sys.stderr, flush=True)
        runs[mode] = launch_self(__file__, 2, ["--mode", mode, *passed], f"mode {mode}")
        runs[mode]["planner"] = planned(mode, cli)
    emit({"benchmark": "pipeline", "settings": vars(cli) | {"worker": None}, "runs": runs}, cli.out)


if __name__ == "__main__":
    main()
