"""GPU throughput: a ~1.2B-parameter Llama trained with shardtrain's Trainer and with a raw `fully_shard` loop.

    python benchmarks/gpu.py --out gpu.json                  # CUDA: every GPU of the machine, 1B Llama, bf16
    python benchmarks/gpu.py --tiny --out /tmp/gpu_tiny.json # CPU (gloo), a tiny Llama: what the test suite runs

One `python -m torch.distributed.run --nproc_per_node <GPUs>` launch of this file (`--worker`) runs six modes one
after the other on the same model (Llama-3.2-1B's shape, built from a config, random weights and tokens; nothing
is downloaded): {trainer, raw, hf} x {eager, compile}, all with bf16, activation checkpointing on every decoder
layer, fused AdamW, clipping at 1.0. `trainer` is `shardtrain.Trainer` (fsdp_config activation_checkpointing,
`torch_compile`; FSDP2 `MixedPrecisionPolicy`: bf16 compute, fp32 reductions and master weights); `raw` is the
smallest loop on `fully_shard` with the same settings (per-layer `checkpoint_wrapper` and `module.compile()`);
`hf` is transformers' own Trainer (`bf16=True`: autocast over fp32 weights, `gradient_checkpointing`, DDP when
there are several GPUs: the whole model state on every GPU). A mode that fails records its error; the others run.

Reported per mode: tokens/s per GPU and step time (median of the timed steps, after --warmup), MFU = model
FLOPs per step (6 x parameters except the input-embedding lookup x tokens + 12 x layers x hidden x seq x tokens,
PaLM's count) / step time / the device's peak dense bf16 FLOP/s (known devices below, or --peak-tflops), peak memory
(`torch.cuda.max_memory_allocated`; on CPU none), the first step's time (compile happens there) and the losses.
`planned` is `shardtrain.plan`'s prediction (run before the ranks start) for the trainer modes' layout (peak memory
per GPU, step time from the traced FLOPs at a bf16 matmul rate it measures on this device), next to what the trainer
modes measured; on a torch older than the planner supports it holds the planner's error instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LLAMA_1B = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
            "max_position_embeddings": 4096}
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True, "max_position_embeddings": 128}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense
# the trainer modes' layout, and what the planner is asked to predict
TRAINER_FSDP_CONFIG = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "activation_checkpointing": True}
MODES = ("trainer_eager", "hf_eager", "raw_eager", "trainer_compile", "raw_compile", "hf_compile")  # first: most asked


def model_flops_per_token(config: dict[str, Any], seq: int, non_embedding_params: int) -> float:
    return 6.0 * non_embedding_params + 12.0 * config["num_hidden_layers"] * config["hidden_size"] * seq


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in device_name), None)


def plan_prediction(shape: dict[str, Any], world: int, seq: int, batch: int, cuda: bool) -> dict[str, Any]:
    """`shardtrain.plan` on the trainer modes' layout: peak memory per rank and step time (bf16 matmul rate
    measured on this device; with several GPUs the link rate is a local copy's, a stand-in)."""
    from transformers import LlamaConfig

    from shardtrain.errors import PlanError
    from shardtrain.plan import plan

    try:
        result = plan(LlamaConfig(**shape), fsdp_config=TRAINER_FSDP_CONFIG, world_size=world,
                      per_device_batch=batch, seq_len=seq, bf16=True, target="cuda" if cuda else "cpu",
                      what_if=False)
    except PlanError as err:  # e.g. an older torch on the GPU machine: the benchmark itself still runs
        return {"error": str(err)}
    step = result.step or {}
    return {"peak_memory_gib": round(result.peak / 2**30, 3),
            "step_s_no_overlap": round(step.get("step_s_no_overlap", 0.0), 4),
            "step_s_full_overlap": round(step.get("step_s_full_overlap", 0.0), 4),
            "compute_s": round(step.get("compute_s", 0.0), 4), "flops_rate": step.get("flops_rate"),
            "flops_rate_source": step.get("flops_rate_source"), "traced_flops": step.get("flops")}


class StepProfiler:
    """`torch.profiler` over steps [first, first + count) of a run (0-based, after the timed steps): per-step
    device (or CPU) busy time of the kernels and the top ops, kept for the mode's JSON entry. count 0: nothing."""

    def __init__(self, first: int, count: int, cuda: bool) -> None:
        self.first, self.count, self.cuda = first, count, cuda
        self.profiler: Any = None
        self.summary: dict[str, Any] | None = None

    def before(self, step: int) -> None:
        if self.count and step == self.first:
            import torch.profiler as tp

            kinds = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = tp.profile(activities=kinds)
            self.profiler.__enter__()

    def after(self, step: int) -> None:
        if self.profiler is None or step != self.first + self.count - 1:
            return
        self.profiler.__exit__(None, None, None)
        events = self.profiler.key_averages()
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        busy = sum(getattr(e, key) for e in events if not self.cuda or e.device_type.name == "CUDA")
        self.summary = {"steps": self.count, "busy_ms_per_step": round(busy / 1e3 / self.count, 2),
                        "busy_of": "CUDA kernels" if self.cuda else "CPU ops (self time)",
                        "top_ops": events.table(sort_by=key, row_limit=20, max_name_column_width=60)}
        self.profiler = None


def worker(cli: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtrain import Trainer, TrainerCallback, TrainingArguments
    from shardtrain.parallel.distributed import current_device, destroy_distributed, init_distributed

    init_distributed()
    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    shape = TINY if cli.tiny else LLAMA_1B
    seq, batch = cli.seq, cli.batch
    total = cli.warmup + cli.steps + cli.profile_steps  # profiled steps come last: the timed ones run unprofiled
    cuda = device.type == "cuda"

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))

    def samples() -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(1)
        return [{"input_ids": ids, "labels": ids} for ids in
                torch.randint(0, shape["vocab_size"], (total * batch * world, seq), generator=gen)]

    profiled_modes = set((cli.profile_modes or cli.modes).split(","))

    def profiler() -> StepProfiler:
        count = cli.profile_steps if mode in profiled_modes else 0  # `mode`: the one the loop below runs now
        return StepProfiler(cli.warmup + cli.steps, count, cuda)

    def raw_run(compile_: bool) -> tuple[list[float], list[float], StepProfiler]:
        model = build().to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for index, layer in enumerate(model.model.layers):
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=True)  # as the Trainer
            if compile_:
                wrapped.compile()
            fully_shard(wrapped, mp_policy=mp)
            model.model.layers[index] = wrapped
        fully_shard(model, mp_policy=mp)
        if dist.get_backend() == "gloo":
            for module in model.modules():
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        data = samples()[rank::world]
        times, losses, prof = [], [], profiler()
        for step in range(total):
            prof.before(step)
            started = time.perf_counter()
            ids = torch.stack([s["input_ids"] for s in data[step * batch:(step + 1) * batch]]).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # syncs the device: the step is done
            times.append(time.perf_counter() - started)
            prof.after(step)
        return times, losses, prof

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.prof = profiler()

        def on_step_begin(self, args, state, control, **kwargs):
            self.prof.before(state.global_step)
            if not self.marks:
                self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
            self.prof.after(state.global_step - 1)  # on_step_end comes after the step count moved on

    def run_trainer(trainer_cls: Any, args_cls: Any, compile_: bool, **settings: Any
                    ) -> tuple[list[float], list[float], StepProfiler]:
        """A Trainer run with this benchmark's common arguments plus `settings`: step times, logged losses."""
        timer = Timer()
        args = args_cls(output_dir=tempfile.mkdtemp(), bf16=True, torch_compile=compile_,
                        per_device_train_batch_size=batch, max_steps=total, learning_rate=1e-4,
                        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                        disable_tqdm=True, **settings)
        trainer = trainer_cls(build(), args, train_dataset=samples(), callbacks=[timer])
        trainer.train()
        times = [b - a for a, b in zip(timer.marks, timer.marks[1:], strict=False)]
        return times, [e["loss"] for e in trainer.state.log_history if "loss" in e], timer.prof

    def hf_run(compile_: bool) -> tuple[list[float], list[float], StepProfiler]:
        import transformers

        return run_trainer(transformers.Trainer, transformers.TrainingArguments, compile_,
                           optim="adamw_torch_fused", gradient_checkpointing=True,
                           gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=not cuda)

    def trainer_run(compile_: bool) -> tuple[list[float], list[float], StepProfiler]:
        return run_trainer(Trainer, TrainingArguments, compile_, fsdp=True, fsdp_config=dict(TRAINER_FSDP_CONFIG))

    with torch.device("meta"):
        meta = build()
    params = sum(p.numel() for p in meta.parameters())
    # the input embedding is a lookup (no FLOPs); a tied head shares its weight but still multiplies
    non_embedding = params - (0 if shape["tie_word_embeddings"] else shape["vocab_size"] * shape["hidden_size"])
    flops_per_step = model_flops_per_token(shape, seq, non_embedding) * seq * batch  # per GPU
    peak = peak_flops(torch.cuda.get_device_name(device) if cuda else "cpu", cli.peak_tflops)
    runs = {"trainer": trainer_run, "raw": raw_run, "hf": hf_run}
    results: dict[str, Any] = {}
    for mode in cli.modes.split(","):
        gc.collect()  # the previous mode's model and optimizer (FSDP keeps reference cycles)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        kind, how = mode.split("_")
        error = None
        try:
            times, losses, prof = runs[kind](how == "compile")
        except Exception as err:  # noqa: BLE001 - one prepared GPU run: a failing mode must not cost the others
            error = f"{type(err).__name__}: {err}"[:2000]
            print(f"[gpu benchmark] mode {mode} failed on rank {rank}: {error}", flush=True)
        # every rank learns whether any failed, so all go on to the next mode together. A failure after the mode's
        # last collective (the profiler's stop raised std::bad_alloc on one rank on CPU) used to leave that rank
        # in a barrier while the others started the next mode: a hang. One in the middle of a mode still waits
        # for the collective's timeout.
        failed = torch.tensor([float(error is not None)], device=device)
        dist.all_reduce(failed)
        if failed.item():
            results[mode] = {"error": error or f"failed on {int(failed.item())} other rank(s); see their output"}
            continue
        median = statistics.median(times[cli.warmup:cli.warmup + cli.steps])
        results[mode] = {
            "step_s_median": round(median, 4), "first_step_s": round(times[0], 3),
            "tokens_per_s_per_gpu": round(seq * batch / median, 1),
            "mfu": round(flops_per_step / median / peak, 4) if peak else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None,
            "losses": [round(loss, 5) for loss in losses]}
        if prof.summary is not None:
            results[mode]["profile"] = prof.summary
        if rank == 0 and cli.progress:  # what a run cut off by its time limit still leaves
            with open(cli.progress, "a") as progress:
                progress.write(json.dumps({mode: results[mode]}) + "\n")
        dist.barrier()
    if rank == 0:
        Path(cli.out_file).write_text(json.dumps({
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "world_size": world,
            "params": params, "non_embedding_params": non_embedding, "seq_len": seq, "per_device_batch": batch,
            "peak_bf16_flops": peak, "model_flops_per_step_per_gpu": flops_per_step,
            "torch": torch.__version__, "modes": results}))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama on CPU (what the tests run)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10, tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, tiny 1)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, tiny 32)")
    parser.add_argument("--batch", type=int, default=None, help="per-GPU batch (default 2, tiny 2)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; tiny 2)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="torch.profiler over this many more steps after the timed ones; per mode: busy time "
                             "per step and the top ops")
    parser.add_argument("--profile-modes", default=None,
                        help="the modes --profile-steps profiles (comma-separated; default: every mode run)")
    parser.add_argument("--progress", default=None, help="append each finished mode's JSON line to this file")
    cli = parser.parse_args()
    cli.steps = cli.steps or (3 if cli.tiny else 10)
    cli.warmup = cli.warmup if cli.warmup is not None else (1 if cli.tiny else 3)
    cli.seq, cli.batch = cli.seq or (32 if cli.tiny else 2048), cli.batch or 2
    if cli.worker:
        worker(cli)
        return
    import torch
    from bench_common import emit, launch_self

    nproc = cli.nproc or (2 if cli.tiny else max(torch.cuda.device_count(), 1))
    args = ["--modes", cli.modes, "--steps", str(cli.steps), "--warmup", str(cli.warmup), "--seq", str(cli.seq),
            "--batch", str(cli.batch), *(["--tiny"] if cli.tiny else []),
            *(["--peak-tflops", str(cli.peak_tflops)] if cli.peak_tflops else []),
            *(["--progress", str(Path(cli.progress).resolve())] if cli.progress else []),
            "--profile-steps", str(cli.profile_steps), *(["--profile-modes", cli.profile_modes] if cli.profile_modes
                                                         else [])]
    # the planner runs its own fake process group: here, before the ranks start theirs
    planned = plan_prediction(TINY if cli.tiny else LLAMA_1B, nproc, cli.seq, cli.batch,
                              torch.cuda.is_available() and not cli.tiny)
    result = {"benchmark": "gpu", "tiny": cli.tiny, **launch_self(Path(__file__), nproc, args, "gpu worker",
                                                                  cpu=cli.tiny)}
    result["planned"] = planned  # beside modes.trainer_*: the same layout
    emit(result, cli.out)


if __name__ == "__main__":
    main()
