"""`shardtrain plan`'s predicted per-rank peak against the peak measured in real Trainer runs (torchrun, gloo).

    .venv/bin/python benchmarks/plan_validation.py --out benchmarks/results/plan_validation.json   # every config
    .venv/bin/python benchmarks/plan_validation.py --configs tiny --out /tmp/v.json          # the test's subset

Prints one JSON object (predicted and measured side by side per config) and writes it to --out. Each group of
configs with the same number of ranks runs in ONE `torch.distributed.run` launch of this file (`--worker`), jobs
one after the other; the predictions run afterwards in this process (`shardtrain.plan.plan`, target "cpu").

The measurement is independent of the planner's tracker: c10's CPU allocator keeps a byte count of the tensors
alive (`FLAGS_caffe2_report_cpu_memory_usage`, switched on at start so that tensors freed by gloo's threads are
counted too), and `torch.profiler.profile(profile_memory=True)` records that count at every allocation of the
training thread. The measured peak is the highest count inside the 3 training steps (marked with
`record_function`), minus the count before the model was built; the largest rank is compared.
"""

from __future__ import annotations

import argparse
import ctypes
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
LAYERS = {"tiny": ["LlamaDecoderLayer"], "50m": ["LlamaDecoderLayer"], "moe": ["Qwen3MoeDecoderLayer"]}
# A small Qwen3-MoE (8 experts, top-2; ~6.6M parameters), as in benchmarks/expert_parallel.py
MOE = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "num_experts": 8, "num_experts_per_tok": 2}

# name, size (bench_common.SIZES), ranks, fsdp_config keys, bf16, cp, accum (gradient accumulation steps)
CONFIGS: list[dict] = [
    {"name": "50m N1", "size": "50m", "nproc": 1, "fsdp": {}},
    {"name": "50m N2", "size": "50m", "nproc": 2, "fsdp": {}},
    {"name": "50m N4", "size": "50m", "nproc": 4, "fsdp": {}},
    {"name": "50m N2 no-reshard", "size": "50m", "nproc": 2, "fsdp": {"reshard_after_forward": False}},
    {"name": "50m N2 AC", "size": "50m", "nproc": 2, "fsdp": {"activation_checkpointing": True}},
    {"name": "50m N2 bf16", "size": "50m", "nproc": 2, "fsdp": {}, "bf16": True},
    {"name": "50m N2 offload", "size": "50m", "nproc": 2, "fsdp": {"cpu_offload": True}},
    {"name": "50m N2 GA2", "size": "50m", "nproc": 2, "fsdp": {}, "accum": 2},
    {"name": "50m N4 AC bf16", "size": "50m", "nproc": 4, "fsdp": {"activation_checkpointing": True}, "bf16": True},
    {"name": "tiny N1", "size": "tiny", "nproc": 1, "fsdp": {}},
    {"name": "tiny N2", "size": "tiny", "nproc": 2, "fsdp": {}},
    {"name": "tiny N2 no-reshard", "size": "tiny", "nproc": 2, "fsdp": {"reshard_after_forward": False}},
    {"name": "tiny N2 AC", "size": "tiny", "nproc": 2, "fsdp": {"activation_checkpointing": True}},
    {"name": "tiny N2 bf16", "size": "tiny", "nproc": 2, "fsdp": {}, "bf16": True},
    {"name": "tiny N2 offload", "size": "tiny", "nproc": 2, "fsdp": {"cpu_offload": True}},
    {"name": "tiny N2 GA2", "size": "tiny", "nproc": 2, "fsdp": {}, "accum": 2},
    {"name": "tiny N4", "size": "tiny", "nproc": 4, "fsdp": {}},
    {"name": "tiny N4 cp2", "size": "tiny", "nproc": 4, "fsdp": {}, "cp": 2},
    {"name": "50m N4 tp2", "size": "50m", "nproc": 4, "fsdp": {}, "tp": 2},
    {"name": "tiny N4 tp2", "size": "tiny", "nproc": 4, "fsdp": {}, "tp": 2},
    {"name": "50m N2 LoRA r8", "size": "50m", "nproc": 2, "fsdp": {}, "lora": 8},
    {"name": "tiny N2 LoRA r8", "size": "tiny", "nproc": 2, "fsdp": {}, "lora": 8},
    {"name": "moe N2", "size": "moe", "nproc": 2, "fsdp": {}},
    {"name": "moe N2 ep2", "size": "moe", "nproc": 2, "fsdp": {}, "ep": 2},
    {"name": "moe N4 ep2", "size": "moe", "nproc": 4, "fsdp": {}, "ep": 2},
    {"name": "moe N4 ep4", "size": "moe", "nproc": 4, "fsdp": {}, "ep": 4},
]
# The pytest subset: the tiny Llama on 2 ranks, in one launch.
SUBSETS = {"tiny": [c["name"] for c in CONFIGS if c["size"] == "tiny" and c["nproc"] == 2],
           "lora": [c["name"] for c in CONFIGS if c.get("lora")], "tp": [c["name"] for c in CONFIGS if c.get("tp")],
           "moe": [c["name"] for c in CONFIGS if c["size"] == "moe"]}


def _spec(size: str):  # noqa: ANN202
    """The model's SizeSpec (bench_common.SIZES; the MoE's shape for its batch and data)."""
    sys.path.insert(0, str(HERE))
    from bench_common import SIZES, SizeSpec

    if size == "moe":
        return SizeSpec("moe", vocab_size=MOE["vocab_size"], hidden_size=MOE["hidden_size"],
                        intermediate_size=MOE["intermediate_size"], num_hidden_layers=MOE["num_hidden_layers"],
                        num_attention_heads=MOE["num_attention_heads"],
                        num_key_value_heads=MOE["num_key_value_heads"], seq_len=64, per_device_batch=4)
    return SIZES[size]


def _model_config(size: str):  # noqa: ANN202
    """The transformers config the worker builds and the planner traces."""
    from bench_common import llama_config
    from transformers import Qwen3MoeConfig

    if size == "moe":
        return Qwen3MoeConfig(**MOE, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return llama_config(_spec(size))


def _count_all_threads() -> None:
    """Make c10's CPU allocator count every tensor (any thread), so the profiler's total is the live total."""
    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _events(prof):  # noqa: ANN001, ANN202
    def walk(nodes):  # noqa: ANN001, ANN202
        for node in nodes:
            yield node
            yield from walk(node.children)
    return list(walk(prof.profiler.kineto_results.experimental_event_tree()))


def _measured(prof) -> dict:  # noqa: ANN001
    """Highest live-tensor count in each step window, relative to the count before the model was built."""
    events = _events(prof)
    allocs = sorted((e for e in events if str(e.tag).endswith("Allocation")), key=lambda e: e.start_time_ns)
    steps = sorted((e.start_time_ns, e.end_time_ns) for e in events if e.name == "plan_validation_step")
    first = allocs[0].extra_fields
    base = first.total_allocated - first.alloc_size
    peaks = [0] * len(steps)
    for event in allocs:
        for i, (start, end) in enumerate(steps):
            if start <= event.start_time_ns <= end:
                peaks[i] = max(peaks[i], event.extra_fields.total_allocated - base)
    return {"peak": max(peaks), "per_step": peaks, "baseline": base}


def worker(jobs_path: str, out_path: str) -> None:
    """One rank: each job trains STEPS steps with the Trainer under the profiler; rank 0 writes the results."""
    _count_all_threads()
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    sys.path.insert(0, str(HERE))
    from bench_common import MODEL_SEED, build_model, make_samples
    from transformers import AutoModelForCausalLM

    from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed

    class Marker(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            self.span = record_function("plan_validation_step")
            self.span.__enter__()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            self.span.__exit__(None, None, None)

    results = []
    for job in json.loads(Path(jobs_path).read_text()):
        spec = _spec(job["size"])
        samples = make_samples(spec, 64)
        with tempfile.TemporaryDirectory() as tmp, \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.empty(1)  # the first recorded allocation: the baseline
            fsdp_config = {"transformer_layer_cls_to_wrap": LAYERS[job["size"]], **job["fsdp"]}
            args = TrainingArguments(output_dir=tmp, fsdp=True, fsdp_config=fsdp_config,
                                     max_steps=STEPS, per_device_train_batch_size=spec.per_device_batch,
                                     save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=10**9,
                                     bf16=job.get("bf16", False), cp_size=job.get("cp", 1),
                                     tp_size=job.get("tp", 1), ep_size=job.get("ep", 1), seed=0,
                                     gradient_accumulation_steps=job.get("accum", 1))
            peft_config = None
            if job.get("lora"):  # what the planner adds (plan.trace.with_adapters)
                from peft import LoraConfig

                peft_config = LoraConfig(r=job["lora"], lora_alpha=2 * job["lora"], target_modules="all-linear",
                                         task_type="CAUSAL_LM")
            if job["size"] == "moe":
                torch.manual_seed(MODEL_SEED)
                model = AutoModelForCausalLM.from_config(_model_config("moe"))
            else:
                model = build_model(spec)
            trainer = Trainer(model=model, args=args, train_dataset=samples, callbacks=[Marker()],
                              peft_config=peft_config)
            trainer.train()
            del trainer
            gc.collect()
        mine = _measured(prof)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results.append({"name": job["name"], "per_rank": every})
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    destroy_distributed()


def _launch(nproc: int, jobs: list[dict]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        jobs_path, out_path = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        jobs_path.write_text(json.dumps(jobs))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDTRAIN_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               str(Path(__file__).resolve()), "--worker", str(jobs_path), str(out_path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"worker launch x{nproc} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads(out_path.read_text())


def predict(config: dict) -> dict:
    """`shardtrain.plan.plan` for one config: the bench model's config, the same sizes and fsdp_config."""
    from shardtrain.plan import plan

    spec, model = _spec(config["size"]), _model_config(config["size"])
    result = plan(model, fsdp_config={"transformer_layer_cls_to_wrap": LAYERS[config["size"]], **config["fsdp"]},
                  world_size=config["nproc"], cp=config.get("cp", 1), tp=config.get("tp", 1), ep=config.get("ep", 1),
                  per_device_batch=spec.per_device_batch,
                  seq_len=spec.seq_len, gradient_accumulation_steps=config.get("accum", 1),
                  bf16=config.get("bf16", False), target="cpu", estimate_step_time=False,
                  what_if=False, lora_rank=config.get("lora", 0))
    return {"peak": result.peak, "breakdown": {k: v for k, v in result.trace.peak_breakdown.items() if k != "Total"}}


def run(names: list[str]) -> dict:
    """Measure (one launch per rank count) and predict every named config; predicted vs measured per config."""
    start = time.perf_counter()
    chosen = [c for c in CONFIGS if c["name"] in names]
    measured: dict[str, dict] = {}
    for nproc in sorted({c["nproc"] for c in chosen}):
        for item in _launch(nproc, [c for c in chosen if c["nproc"] == nproc]):
            measured[item["name"]] = item
    rows = []
    for config in chosen:
        per_rank = measured[config["name"]]["per_rank"]
        got = max(r["peak"] for r in per_rank)
        pred = predict(config)
        error = 100.0 * (pred["peak"] - got) / got
        rows.append({"name": config["name"], "size": config["size"], "ranks": config["nproc"],
                     "fsdp_config": config["fsdp"], "bf16": config.get("bf16", False),
                     "cp": config.get("cp", 1), "tp": config.get("tp", 1), "ep": config.get("ep", 1),
                     "gradient_accumulation_steps": config.get("accum", 1), "lora_rank": config.get("lora", 0),
                     "predicted_peak_bytes": pred["peak"], "measured_peak_bytes": got,
                     "predicted_peak_mib": round(pred["peak"] / 2**20, 2), "measured_peak_mib": round(got / 2**20, 2),
                     "error_pct": round(error, 2), "within_tolerance": abs(error) <= 15.0,
                     "measured_peak_per_rank_bytes": [r["peak"] for r in per_rank],
                     "measured_peak_per_step_rank0_bytes": per_rank[0]["per_step"],
                     "predicted_breakdown_bytes": pred["breakdown"]})
    return {"tolerance_pct": 15.0, "steps_measured": STEPS,
            "measurement": "c10 CPU allocator live-tensor bytes (all threads) at each allocation of the training "
                           "thread, via torch.profiler profile_memory; max over the training steps and ranks, minus "
                           "the count before the model was built",
            "prediction": "shardtrain.plan.plan(target='cpu'): rank 0 of a FakeTensorMode + fake process group "
                          "step traced by FSDPMemTracker",
            "configs": rows, "wall_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--configs", default="all", help="'all', 'tiny' (the test's subset) or names joined by ','")
    parser.add_argument("--worker", nargs=2, metavar=("JOBS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    names = [c["name"] for c in CONFIGS] if args.configs == "all" else SUBSETS.get(args.configs) or \
        args.configs.split(",")
    unknown = sorted(set(names) - {c["name"] for c in CONFIGS})
    if unknown:
        print(f"error: unknown config(s) {unknown}; choose from {[c['name'] for c in CONFIGS]}", file=sys.stderr)
        return 2
    result = run(names)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
