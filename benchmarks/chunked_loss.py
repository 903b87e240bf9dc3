"""Chunked vs unchunked cross entropy (`TrainingArguments.loss_chunk_size`): measured training-step memory on
2 FSDP2 ranks beside the planner's prediction, for a 128k-vocabulary tiny Llama.

    .venv/bin/python benchmarks/chunked_loss.py --out benchmarks/results/chunked_loss.json     # ~2 min, 2 ranks

One `python -m torch.distributed.run --nproc_per_node 2` launch of this file (`--worker`, gloo) trains the model
(LlamaConfig(vocab_size=128256, hidden_size=32, 2 layers, untied) with `Trainer(fsdp=True)`, per-device batch
2 x 256 random tokens) for 3 steps per mode, one mode after the other:

  * `unchunked`: today's loss (full fp32 logits of the micro-batch, their log-softmax, its gradient).
  * `chunked`: `loss_chunk_size=64` (64 tokens of logits at a time, recomputed in backward).

Measured as `plan_validation.py` does (c10's CPU allocator counts every live tensor, `torch.profiler` with
`profile_memory` records that count at each allocation), independent of the planner's tracker:

  * `measured_step_peak_bytes`: the highest count inside the training steps minus the count before the model
    was built, the larger rank.
  * `measured_loss_part_bytes`: the loss part: the highest count between the head's input (a forward pre-hook
    on the output embedding) and its gradient (a hook on that input), minus the count when it began; the
    largest over the steps and ranks.

Predicted by `shardtrain.plan.plan(target="cpu", loss_chunk_size=...)` in this process (rank 0's peak and its
loss part, traced the same way on fake tensors). `loss_part_ratio` = unchunked / chunked (goal: >= 3).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 3
VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 128256, 32, 2, 2, 256
MODES = {"unchunked": None, "chunked": 64}
REGION = "chunked_loss_region"


def _spec():  # noqa: ANN202
    sys.path.insert(0, str(HERE))
    from bench_common import SizeSpec

    return SizeSpec("vocab128k", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                    num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, seq_len=SEQ,
                    per_device_batch=BATCH)


class LossRegion:
    """A profiler range from the head's input (forward pre-hook) to its gradient (a tensor hook on it)."""

    def __init__(self, head) -> None:  # noqa: ANN001
        from torch.profiler import record_function

        self.record_function, self.span = record_function, None
        self.handle = head.register_forward_pre_hook(self._start)

    def _start(self, module, args) -> None:  # noqa: ANN001
        hidden = args[0]
        if self.span is None and module.training and hidden.requires_grad:
            self.span = self.record_function(REGION)
            self.span.__enter__()
            hidden.register_hook(self._end)

    def _end(self, grad) -> None:  # noqa: ANN001
        self.span.__exit__(None, None, None)
        self.span = None


def _region_peaks(prof) -> list[int]:  # noqa: ANN001
    """Per loss region: the highest live count inside it minus the count when it began."""
    from plan_validation import _events

    events = _events(prof)
    memory = sorted((e for e in events if str(e.tag).endswith("Allocation")), key=lambda e: e.start_time_ns)
    peaks = []
    for start, end in sorted((e.start_time_ns, e.end_time_ns) for e in events if e.name == REGION):
        before = [e for e in memory if e.start_time_ns < start]
        base = before[-1].extra_fields.total_allocated if before else 0
        inside = [e.extra_fields.total_allocated for e in memory if start <= e.start_time_ns <= end]
        peaks.append(max([base, *inside]) - base)
    return peaks


def worker(out_path: str) -> None:
    """One rank: each mode trains STEPS steps under the profiler; rank 0 writes every rank's figures."""
    from plan_validation import _count_all_threads, _measured

    _count_all_threads()
    import torch
    import torch.distributed as dist
    from bench_common import build_model, make_samples
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed

    class Marker(TrainerCallback):  # the step windows plan_validation._measured reads
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            self.span = record_function("plan_validation_step")
            self.span.__enter__()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            self.span.__exit__(None, None, None)

    spec = _spec()
    results = {}
    for mode, chunk in MODES.items():
        samples = make_samples(spec, 32)
        with tempfile.TemporaryDirectory() as tmp, \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.empty(1)  # the first recorded allocation: the baseline
            args = TrainingArguments(output_dir=tmp, fsdp=True, max_steps=STEPS, per_device_train_batch_size=BATCH,
                                     fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                                     save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1,
                                     seed=0, loss_chunk_size=chunk)
            trainer = Trainer(model=build_model(spec), args=args, train_dataset=samples, callbacks=[Marker()])
            # after the Trainer chose the loss: a foreign hook on the head would make it refuse chunking
            region = LossRegion(trainer.model.get_output_embeddings())
            trainer.train()
            losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
            region.handle.remove()
            del trainer
            gc.collect()
        mine = {**_measured(prof), "loss_regions": _region_peaks(prof), "losses": losses}
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[mode] = every
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    destroy_distributed()


def _launch() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "out.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDTRAIN_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(Path(__file__).resolve()),
               "--worker", str(out_path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"worker launch failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads(out_path.read_text())


def _predict(chunk: int | None) -> dict:
    from bench_common import llama_config

    from shardtrain.plan import plan

    result = plan(llama_config(_spec()), fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                  world_size=2, per_device_batch=BATCH, seq_len=SEQ, target="cpu", estimate_step_time=False,
                  what_if=False, loss_chunk_size=chunk)
    return {"peak": result.peak, "loss_part": result.trace.loss_peak, "logits": result.trace.logits}


def run() -> dict:
    """Measure both modes (one launch) and predict them; side by side."""
    start = time.perf_counter()
    measured = _launch()
    rows = {}
    for mode, chunk in MODES.items():
        per_rank, pred = measured[mode], _predict(chunk)
        got_peak = max(r["peak"] for r in per_rank)
        got_loss = max(max(r["loss_regions"]) for r in per_rank)
        rows[mode] = {"loss_chunk_size": chunk or 0, "measured_step_peak_bytes": got_peak,
                      "measured_loss_part_bytes": got_loss, "predicted_peak_bytes": pred["peak"],
                      "predicted_loss_part_bytes": pred["loss_part"], "predicted_logits_bytes": pred["logits"],
                      "measured_step_peak_mib": round(got_peak / 2**20, 1),
                      "measured_loss_part_mib": round(got_loss / 2**20, 1),
                      "predicted_peak_mib": round(pred["peak"] / 2**20, 1),
                      "predicted_loss_part_mib": round(pred["loss_part"] / 2**20, 1),
                      "peak_error_pct": round(100.0 * (pred["peak"] - got_peak) / got_peak, 2),
                      "measured_loss_part_per_rank_bytes": [max(r["loss_regions"]) for r in per_rank],
                      "measured_step_peak_per_rank_bytes": [r["peak"] for r in per_rank],
                      "losses_rank0": per_rank[0]["losses"]}
    full, chunked = rows["unchunked"], rows["chunked"]
    return {"model": {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                      "tie_word_embeddings": False},
            "ranks": 2, "per_device_batch": BATCH, "seq_len": SEQ, "steps_measured": STEPS, "modes": rows,
            "measured_loss_part_ratio": round(full["measured_loss_part_bytes"] / chunked["measured_loss_part_bytes"],
                                              2),
            "predicted_loss_part_ratio": round(full["predicted_loss_part_bytes"]
                                               / chunked["predicted_loss_part_bytes"], 2),
            "measured_step_peak_ratio": round(full["measured_step_peak_bytes"] / chunked["measured_step_peak_bytes"],
                                              2),
            "max_loss_difference": max(abs(a - b) for a, b in zip(full["losses_rank0"], chunked["losses_rank0"],
                                                                   strict=True)),
            "measurement": "c10 CPU allocator live-tensor bytes (all threads) via torch.profiler profile_memory: "
                           "step peak minus the count before the model was built; loss part = peak between the "
                           "head's input and its gradient minus the count at its start; max over steps and ranks",
            "prediction": "shardtrain.plan.plan(target='cpu', loss_chunk_size=...): rank 0 traced on fake tensors",
            "command": "python benchmarks/chunked_loss.py --out benchmarks/results/chunked_loss.json",
            "wall_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.worker:
        worker(args.worker)
        return 0
    from bench_common import emit

    emit(run(), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
