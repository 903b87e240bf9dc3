"""Pipeline parallelism against FSDP alone on the same model and global batch: per-rank state memory, peak RSS and
step time next to the planner's, and each schedule's measured idle share against its theoretical bubble.

    .venv/bin/python benchmarks/pipeline.py --out benchmarks/results/pipeline.json     # ~10 min, 2 ranks
    .venv/bin/python benchmarks/pipeline.py --schedules Interleaved1F1B,InterleavedZeroBubble,ZBVZeroBubble,DualPipeV \
        --microbatches 4,8 --out benchmarks/results/pipeline_two_stages.json      # two stages per rank, ~12 min
    .venv/bin/python benchmarks/pipeline.py --microbatches 4 --steps 4 --hidden 256 --out /tmp/pp.json   # quick

One `python -m torch.distributed.run --nproc_per_node 2` launch of this file (`--worker`, gloo, OMP_NUM_THREADS=1
per rank) per mode, each `shardtrain.Trainer` on the same fp32 Llama (8 layers, hidden 1024, vocabulary 256: a
small head, so that the stages take the same time, as the bubble's formula assumes; and layers large enough that
a pass is long next to a message), the same token ids (fixed length, no padding) and the same per-rank batch of
`--batch` sequences of `--seq` tokens:

  * `fsdp`: FSDP2 over both ranks (data parallel; the reference): the global batch is 2 x batch.
  * `<schedule>_m<M>`: pp 2 with M microbatches per micro-batch: GPipe or 1F1B (one stage per rank, 4 layers
    each), or a schedule of two stages per rank (2 layers each: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV); the global batch is the batch (both ranks see the same samples).

Measured per rank: the bytes of its parameters, gradients and optimizer state (local shards, at the second step),
against `plan.pipeline_estimate.stage_state_bytes` of the stage's parameters and the planner's traced state
(`shardtrain.plan(..., pp=2)`: the stage that peaks, with the microbatches it holds in flight; its tensor peak is
reported too, next to the process's peak RSS, which also holds the runtime) and predicted step; the process's
peak RSS; the median step time after warm-up and tokens per second (global tokens / step time). For the pipeline
modes, the idle share of the pipeline's step (from the first rank entering `schedule.step` to the last leaving
it): 1 - the rank's own work (its stages' forward, backward, input- and weight-gradient passes, the loss, its
gradient reduction) / the step, both ranks' mean, next to the schedule's bubble (`bubble_fraction`: (p - 1) /
(m + p - 1) for GPipe and 1F1B; what torch's table of the schedule gives with passes of equal time) and the
bubble of the same table played with this run's measured passes (`idle_against_theory`). On 2 CPU cores each
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


def build_model(cli: argparse.Namespace):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=cli.vocab, hidden_size=cli.hidden, intermediate_size=cli.hidden * 43 // 16,
                         num_hidden_layers=cli.layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=max(512, cli.seq), attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def timed(function, busy: list[float], each: list[float] | None = None):
    """`function` that adds its wall time to busy[0] (and appends it to `each`)."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            busy[0] += took
            if each is not None:
                each.append(took)
    return wrapper


def worker(cli: argparse.Namespace) -> None:
    import json
    import tempfile

    import torch
    import torch.distributed as dist
    from bench_common import grad_bytes, optimizer_state_bytes, param_bytes, peak_rss_bytes

    from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed
    from shardtrain.plan.pipeline_estimate import in_flight, stage_state_bytes

    pipelined = cli.mode != "fsdp"
    schedule, microbatches = (cli.mode.split("_m")[0], int(cli.mode.split("_m")[1])) if pipelined else (None, None)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in
            torch.randint(0, cli.vocab, (cli.batch * 2 * (cli.steps + 1), cli.seq), generator=gen).tolist()]
    pp = {"pp_size": 2, "pp_schedule": schedule, "pp_microbatches": microbatches} if pipelined else {}
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), fsdp=True, per_device_train_batch_size=cli.batch,
                             max_steps=cli.steps, learning_rate=1e-3, save_strategy="no", report_to="none",
                             disable_tqdm=True, logging_steps=10**9, **pp)
    model = build_model(cli)
    trainer = Trainer(model, args, train_dataset=data)
    busy, marks, state = [0.0], [], {}
    windows: list[tuple[float, float]] = []  # each schedule step's (start, end), on the machine's monotonic clock
    pipeline = trainer.pipeline
    passes: dict[str, list[float]] = {}  # each pass's time, by "stage pass" (F, I, W, B; "loss"; "reduce")
    if pipeline is not None:  # busy: the rank's own work; windows: the whole schedule step (work + waiting)
        for stage in pipeline.stages:
            names = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W", "perform_reduce_grad": "reduce"}
            for method, name in names.items():
                each = passes.setdefault(f"{stage.stage_index} {name}", [])
                setattr(stage, method, timed(getattr(stage, method), busy, each))
            # a backward is a full one ("B") or, under a zero-bubble schedule, its input pass ("I")
            full, input_only = (timed(stage.backward_one_chunk, busy, passes.setdefault(f"{stage.stage_index} {n}", []))
                                for n in ("B", "I"))
            stage.backward_one_chunk = lambda *a, _f=full, _i=input_only, **k: \
                (_f if k.get("full_backward", True) else _i)(*a, **k)
        schedule_object = pipeline.schedule  # the last stage's loss is its work too
        schedule_object._maybe_compute_loss = timed(schedule_object._maybe_compute_loss, busy,
                                                    passes.setdefault("loss", []))
        step = schedule_object.step

        def windowed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                windows.append((start, time.perf_counter()))
        schedule_object.step = windowed
    per_step: list[float] = []  # busy[0] at each step's begin and end

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append(time.perf_counter())
            per_step.append(busy[0])

        def on_pre_optimizer_step(self, args, trainer_state, control, model=None, optimizer=None, **k):
            if trainer_state.global_step == 1:  # the second step: AdamW's slots exist (made at the first)
                state.update(params=param_bytes(model), grads=grad_bytes(model),
                             optimizer=sum(optimizer_state_bytes(optimizer).values()))

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())
            per_step.append(busy[0])

    trainer.add_callback(Clock())
    trainer.train()
    steps = [marks[i + 1] - marks[i] for i in range(0, len(marks), 2)][cli.warmup:]
    busy_s = [per_step[i + 1] - per_step[i] for i in range(0, len(per_step), 2)][cli.warmup:]
    stage_params = sum(p.numel() for p in trainer.model.parameters())  # this stage's (all of it without pp)
    dp = trainer.dims.dp_shard
    mine: dict[str, Any] = {
        "rank": dist.get_rank(), "state_bytes": state, "state_bytes_total": sum(state.values()),
        "predicted_state_bytes": stage_state_bytes(stage_params, dp=dp), "peak_rss_bytes": peak_rss_bytes(),
        "step_time_s_median": statistics.median(steps)}
    if pipeline is not None:
        stage = pipeline.split.stage
        measured_windows = windows[cli.warmup:]  # one schedule step per optimizer step (no accumulation)
        mine.update(windows=measured_windows, busy_s=busy_s,
                    pass_s_median={k: statistics.median(v) for k, v in passes.items() if v},
                    stage=stage, stages=list(pipeline.split.held),
                    layers=[[r.start, r.stop] for r in pipeline.split.layers],
                    schedule_share_of_step=statistics.median((end - start) / t for (start, end), t in
                                                             zip(measured_windows, steps, strict=True)),
                    in_flight_microbatches=in_flight(schedule, stages=2, microbatches=microbatches, stage=stage))
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        global_tokens = cli.batch * cli.seq * trainer.dims.batch_size
        result = {"mode": cli.mode, "layout": trainer.dims.describe(), "global_tokens_per_step": global_tokens,
                  "step_time_s_median": max(r["step_time_s_median"] for r in ranks),
                  "tokens_per_s": global_tokens / max(r["step_time_s_median"] for r in ranks), "ranks": ranks}
        if pipeline is not None:
            result.update(idle_against_theory(ranks, pipeline, schedule, microbatches))
        Path(cli.out_file).write_text(json.dumps(result))
    destroy_distributed()


def idle_against_theory(ranks: list[dict[str, Any]], pipeline: Any, schedule: str, microbatches: int
                        ) -> dict[str, Any]:
    """The measured idle share of the pipeline's step (both ranks' mean) against the bubble of the schedule's own
    table played two ways: with passes of equal time (`bubble_fraction`, the theory) and with this run's passes as
    measured (each stage's median forward, backward or input and weight pass, the loss on the last, and each
    rank's gradient reduction at its end), messages free in both: what the stages' own imbalance explains; the
    rest of the measured idle is the messages and the schedule's bookkeeping."""
    from shardtrain.plan.pipeline_estimate import bubble_fraction, fill_drain_table, play

    # the pipeline's step: from the first rank entering the schedule to the last leaving it (one machine:
    # perf_counter is one clock for every process); a rank's idle share is the rest of it beside its own work
    spans = [max(r["windows"][i][1] for r in ranks) - min(r["windows"][i][0] for r in ranks)
             for i in range(len(ranks[0]["windows"]))]
    for r in ranks:
        r["idle_share_of_pipeline_step"] = statistics.median(
            1 - b / w for b, w in zip(r.pop("busy_s"), spans, strict=True))
        r.pop("windows")
    measured = statistics.fmean(r["idle_share_of_pipeline_step"] for r in ranks)
    stages = pipeline.split.stages
    medians = {k: v for r in ranks for k, v in r["pass_s_median"].items()}
    durations = {(int(k.split()[0]), k.split()[1]): v for k, v in medians.items() if k.split()[-1] in "FIWB"}
    durations[(stages - 1, "F")] += medians.get("loss", 0.0)
    table = pipeline.schedule.pipeline_order if len(pipeline.stages) > 1 else \
        fill_drain_table(schedule, stages=stages, microbatches=microbatches)
    played = play(table, stages=stages, durations=durations)
    reduce = {r["rank"]: sum(v for k, v in r["pass_s_median"].items() if k.endswith(" reduce")) for r in ranks}
    step = max(played.finish[rank] + reduce[rank] for rank in played.finish)
    as_run = statistics.fmean(1 - (played.busy[rank] + reduce[rank]) / step for rank in played.busy)
    theory = bubble_fraction(schedule, stages=2, microbatches=microbatches)
    return {"pipeline_step_s_median": statistics.median(spans), "bubble_theory": theory,
            "bubble_with_measured_passes": as_run, "played_step_s": step, "idle_share_measured": measured,
            "idle_vs_theory": measured / theory, "idle_vs_measured_passes": measured / as_run}


def planned(mode: str, cli: argparse.Namespace) -> dict[str, Any]:
    """`shardtrain.plan` of the same run (target cpu, the rates measured here, one thread per rank): the traced
    stage's state and tensor peak, and the predicted step (compute and collectives, over 1 - the bubble)."""
    import shardtrain

    pp = {}
    if mode != "fsdp":
        schedule, microbatches = mode.split("_m")
        pp = {"pp": 2, "pp_schedule": schedule, "pp_microbatches": int(microbatches)}
    result = shardtrain.plan(build_model(cli), world_size=2, per_device_batch=cli.batch, seq_len=cli.seq,
                             target="cpu", what_if=False, **pp)
    step = {k: result.step[k] for k in ("compute_s", "comm_s", "step_s_no_overlap", "step_s_full_overlap")}
    return {"state_bytes": sum(result.trace.state.values()), "tensor_peak_bytes": result.trace.peak,
            "pipeline": result.settings.get("pipeline"), "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--schedules", default="GPipe,1F1B")
    parser.add_argument("--microbatches", default="2,4,8", help="comma-separated pp_microbatches to measure")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out")
    cli = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if cli.worker:
        worker(cli)
        return
    from bench_common import emit, launch_self

    passed = [f"--{name}={getattr(cli, name)}" for name in ("batch", "seq", "hidden", "layers", "vocab", "steps",
                                                            "warmup")]
    modes = ["fsdp"] + [f"{s}_m{m}" for s in cli.schedules.split(",") for m in cli.microbatches.split(",")]
    runs = {}
    for mode in modes:
        print(f"[pipeline] {mode}", file=sys.stderr, flush=True)
        runs[mode] = launch_self(__file__, 2, ["--mode", mode, *passed], f"mode {mode}")
        runs[mode]["planner"] = planned(mode, cli)
    emit({"benchmark": "pipeline", "settings": vars(cli) | {"worker": None}, "runs": runs}, cli.out)


if __name__ == "__main__":
    main()
