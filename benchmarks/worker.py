"""One benchmark measurement; `compare.py` launches it (this is what it runs):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 --master_port 29511 \\
        benchmarks/worker.py --mode raw --size tiny --steps 60 --warmup 10 --out /tmp/raw_tiny.json
    # --mode raw | shardtrain | hf   (training throughput + memory, 2 ranks); raw_head: raw + a norm/lm_head unit;
    #        shardtrain_glibc_malloc | shardtrain_no_shard | shardtrain_compile | shardtrain_gloo_reduce_scatter |
    #        shardtrain_thread_arenas: variants (SHARDTRAIN_VARIANTS)
    # --mode state --sizes tiny,50m  (model-state bytes per rank after one AdamW step, any number of ranks;
    #                                 --submeshes 1,2,4 on 4 ranks measures N = 1, 2, 4 in one launch)
    OMP_NUM_THREADS=1 python benchmarks/worker.py --mode single --sizes tiny,50m --steps 10 --warmup 2 \\
        --out /tmp/single.json       # one process, no FSDP, per-rank batch: the compute lower bound
    # --profile torch    (raw / shardtrain / hf: torch.profiler key_averages of rank 0 -> <out>.profile.txt)
    # --profile cprofile (raw / shardtrain / hf: cProfile of rank 0's timed steps -> <out>.cprofile.txt, .pstats)
    # --profile stages   (raw / shardtrain: wall, user, sys ms and page faults per stage -> <out>.stages.json)

Rank 0 writes one JSON object to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    FUSED_ADAMW,
    LAYER_CLASS,
    LEARNING_RATE,
    MAX_GRAD_NORM,
    SEED,
    SIZES,
    WEIGHT_DECAY,
    MemoryBaseline,
    SizeSpec,
    StepTimer,
    build_model,
    gather_to_rank0,
    grad_bytes,
    make_samples,
    optimizer_state_bytes,
    param_bytes,
    sharding_facts,
    stack,
    summarize_steps,
)
from meters import Profiler, StageMeter
from reference_runs import run_single, run_state
from torch.distributed.tensor import DTensor


# -- distributed set-up --------------------------------------------------------------------------------
def init_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")


def data_for_run(spec: SizeSpec, world: int, total_steps: int) -> list[dict[str, torch.Tensor]]:
    """Exactly one epoch: `total_steps` global batches of per_device_batch x world samples."""
    return make_samples(spec, total_steps * spec.per_device_batch * world)


def finish(result: dict[str, Any], baseline: MemoryBaseline, out: Path, per_rank: dict[str, Any]) -> None:
    per_rank = {**per_rank, **baseline.report()}
    ranks = gather_to_rank0(per_rank)
    if dist.get_rank() == 0:
        result["per_rank"] = ranks
        result["peak_rss_delta_bytes_max"] = max(r["peak_rss_delta_bytes"] for r in ranks)
        out.write_text(json.dumps(result, indent=1))


def record_grad_bytes_once(optimizer: torch.optim.Optimizer, model: Any, holder: dict[str, Any]) -> None:
    """Store this rank's gradient bytes in holder["grad_bytes"] at the first optimizer step (the grads exist then)."""

    def measure(opt: Any, *_: Any) -> None:
        if not holder["grad_bytes"]:
            holder["grad_bytes"] = grad_bytes(model)

    optimizer.register_step_pre_hook(measure)


# -- raw: the smallest loop on fully_shard ------------------------------------------------------------
def run_raw(cli: argparse.Namespace, spec: SizeSpec) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    total = cli.warmup + cli.steps
    samples = data_for_run(spec, world, total)
    baseline = MemoryBaseline()
    model = build_model(spec)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if cli.head_unit:  # shardtrain's extra unit: final norm + lm_head, kept gathered between forward and backward
        fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG: SUM, then divide
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                                  fused=FUSED_ADAMW)
    model.train()
    batch_size = spec.per_device_batch
    loss_sum = torch.zeros(())
    grads_bytes = 0
    timer, prof = StepTimer(), Profiler(cli.profile, cli.out, rank, cli.steps)
    stage = StageMeter(cli.profile == "stages" and rank == 0, cli.out)
    timer.mark()
    for step in range(total):
        if step == cli.warmup:
            prof.start()
            stage.active = True
        with stage("data"):
            start = (step * world + rank) * batch_size
            batch = stack(samples[start:start + batch_size])
        with stage("forward + loss"):
            loss = model(**batch).loss
        with stage("backward"):
            loss.backward()
        with stage("clip grad norm"):
            # no list of the grads survives this block: it would keep them alive into the next step
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None],
                                                 norm_type=2.0, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_GRAD_NORM, norm, foreach=True)
        if step == 0:
            grads_bytes = grad_bytes(model)
        with stage("optimizer.step"):
            optimizer.step()
        with stage("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        timer.mark()
    prof.stop()
    stage.write(cli.steps)
    tokens = spec.per_device_batch * spec.seq_len * world
    result = {"mode": "raw_head" if cli.head_unit else "raw", "size": spec.name, "world_size": world,
              "timing": summarize_steps(timer.durations(), timer.cpu_durations(), cli.warmup, tokens),
              "rusage_per_step_rank0": timer.usage_per_step(cli.warmup),
              "mean_loss_rank0": float(loss_sum) / total, "sharding": sharding_facts(model)}
    per_rank = {"param_bytes": param_bytes(model), "grad_bytes": grads_bytes,
                "optimizer_state_bytes": optimizer_state_bytes(optimizer), "sharding": sharding_facts(model)}
    finish(result, baseline, cli.out, per_rank)


# -- shardtrain Trainer --------------------------------------------------------------------------------
# shardtrain variants: mode -> (fsdp_config overrides, TrainingArguments overrides, environment)
SHARDTRAIN_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, str]]] = {
    "shardtrain": ({}, {}, {}),
    "shardtrain_glibc_malloc": ({}, {}, {"SHARDTRAIN_CPU_ALLOCATOR": "default"}),  # glibc's own malloc settings
    "shardtrain_no_shard": ({"sharding_strategy": "NO_SHARD"}, {}, {}),  # DDP-equivalent: replicate, all-reduce
    "shardtrain_shard_grad_op": ({"reshard_after_forward": False}, {}, {}),  # units stay gathered until backward
    # plain data parallel with the whole model as one unit: one all-reduce per step (as DDP's buckets)
    "shardtrain_no_shard_one_unit": ({"sharding_strategy": "NO_SHARD", "auto_wrap_policy": "NO_WRAP"}, {}, {}),
    # the planner picks the layout (fastest predicted that fits; the budget: --fsdp-json max_memory_per_rank or
    # this machine's memory / ranks); it traces before the process group starts, so the Trainer starts it
    "shardtrain_auto": ({"layout": "auto"}, {}, {}),
    "shardtrain_compile": ({}, {"torch_compile": True}, {}),  # each FSDP unit compiled (inductor) before sharding
    # explicit prefetch: each unit's all-gather issued one unit ahead in forward and backward
    "shardtrain_forward_prefetch": ({"forward_prefetch": True}, {}, {}),
    # the session-6 defaults, one change each: gloo's own reduce-scatter; glibc's per-thread malloc arenas
    "shardtrain_gloo_reduce_scatter": ({}, {}, {"SHARDTRAIN_GLOO_REDUCE_SCATTER": "native"}),
    "shardtrain_thread_arenas": ({}, {}, {"SHARDTRAIN_CPU_ALLOCATOR": "default"}),  # + thresholds, see below
}


def _thresholds_only() -> None:
    """The allocator default without its one-arena setting (mallopt thresholds as cpu_allocator sets them)."""
    from shardtrain.parallel import cpu_allocator as ca

    mallopt = ca.glibc_mallopt()
    mallopt(ca.M_MMAP_THRESHOLD, ca.MMAP_THRESHOLD)
    mallopt(ca.M_TRIM_THRESHOLD, ca.TRIM_THRESHOLD)


def run_shardtrain(cli: argparse.Namespace, spec: SizeSpec) -> None:
    from shardtrain import Trainer, TrainingArguments
    from shardtrain.parallel.cpu_allocator import tune_cpu_allocator
    from shardtrain.parallel.distributed import init_distributed
    from shardtrain.train.state import TrainerCallback

    config_overrides, arg_overrides, environment = SHARDTRAIN_VARIANTS[cli.mode]
    os.environ.update(environment)
    if cli.mode == "shardtrain_thread_arenas":
        _thresholds_only()
    config_overrides = {**config_overrides, **json.loads(cli.fsdp_json)}
    auto = config_overrides.get("layout") == "auto"
    if not auto:
        init_distributed()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    total = cli.warmup + cli.steps
    samples = data_for_run(spec, world, total)
    baseline = MemoryBaseline()
    timer, prof = StepTimer(), Profiler(cli.profile, cli.out, rank, cli.steps)
    stage = StageMeter(cli.profile == "stages" and rank == 0, cli.out)
    holder: dict[str, Any] = {"grad_bytes": 0}

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            record_grad_bytes_once(holder["trainer"].optimizer, kwargs["model"], holder)
            timer.mark()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            timer.mark()
            if state.global_step == cli.warmup:
                prof.start()
                stage.active = True

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            prof.stop()
            stage.active = False

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=spec.per_device_batch, max_steps=total,
            learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
            lr_scheduler_type="linear", warmup_steps=0, seed=SEED, logging_steps=10**9, save_strategy="no",
            report_to="none", disable_tqdm=True, fsdp=True,
            optim="adamw_torch_fused" if FUSED_ADAMW else "adamw_torch", **arg_overrides,
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [LAYER_CLASS],
                         **({} if auto else {"reshard_after_forward": True}),  # auto: the sharding is its choice
                         "state_dict_type": "FULL_STATE_DICT", **config_overrides})
        trainer = Trainer(build_model(spec), args, train_dataset=samples, callbacks=[Timing()])
        holder["trainer"] = trainer
        allocator = tune_cpu_allocator()  # what init_distributed set (None: glibc's own, or the user's settings)
        auto_layout = getattr(trainer, "auto_layout", None)  # absent in commits before "auto" (compare_commits.py)
        choice = auto_layout.choice if auto_layout is not None else None
        if stage.enabled:
            _meter_trainer(stage, trainer, total)
        output = trainer.train()
        state = trainer.state
    stage.write(cli.steps)
    tokens = spec.per_device_batch * spec.seq_len * world
    durations = timer.durations()
    result = {"mode": cli.mode, "size": spec.name, "world_size": world,
              "first_step_s": round(durations[0], 3) if durations else None,  # compile happens here
              "cpu_allocator": allocator,
              "timing": summarize_steps(timer.durations(), timer.cpu_durations(), cli.warmup, tokens),
              "rusage_per_step_rank0": timer.usage_per_step(cli.warmup),
              "global_steps": state.global_step, "mean_loss": output.training_loss,
              "sharding": sharding_facts(trainer.model), "fsdp_overrides": config_overrides,
              "shardtrain_package": str(Path(sys.modules["shardtrain"].__file__).parent),
              "layout_choice": choice.to_dict() if choice is not None else None}
    per_rank = {"param_bytes": param_bytes(trainer.model), "grad_bytes": holder["grad_bytes"],
                "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer),
                "sharding": sharding_facts(trainer.model)}
    finish(result, baseline, cli.out, per_rank)


def _meter_trainer(stage: StageMeter, trainer: Any, total_steps: int) -> None:
    """Time the Trainer's callees by stage (same names as the raw loop's stages where they match)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from shardtrain.train.step import optimizer_step as step_module
    from shardtrain.train.step.loss import LossComputer

    trainer.create_optimizer_and_scheduler(total_steps)  # train() keeps an existing optimizer / scheduler
    stage.wrap(_BaseDataLoaderIter, "__next__", "data")
    stage.wrap(LossComputer, "local_counts", "local token counts")
    stage.wrap(LossComputer, "__call__", "forward + loss")
    stage.wrap(torch.Tensor, "backward", "backward")
    stage.wrap(step_module, "clip_grads", "clip grad norm (one all_reduce)")
    stage.wrap(trainer.optimizer, "step", "optimizer.step")
    stage.wrap(trainer.lr_scheduler, "step", "lr_scheduler.step")
    stage.wrap(trainer.optimizer, "zero_grad", "zero_grad")
    stage.wrap(trainer, "_maybe_log_evaluate_save", "log / evaluate / save checks")
    stage.wrap(trainer, "training_step", "Trainer.training_step (total)")


# -- Hugging Face transformers.Trainer -----------------------------------------------------------------
def run_hf(cli: argparse.Namespace, spec: SizeSpec) -> None:
    import accelerate
    import transformers
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback as HFCallback
    from transformers import TrainingArguments as HFArguments

    init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    total = cli.warmup + cli.steps
    samples = data_for_run(spec, world, total)
    baseline = MemoryBaseline()
    timer, prof = StepTimer(), Profiler(cli.profile, cli.out, rank, cli.steps)
    holder: dict[str, Any] = {"grad_bytes": 0}

    class Timing(HFCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            optimizer = kwargs.get("optimizer")
            inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps the torch optimizer
            if inner is not None:
                record_grad_bytes_once(inner, kwargs.get("model"), holder)
            timer.mark()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            timer.mark()
            if state.global_step == cli.warmup:
                prof.start()

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
            prof.stop()

    result: dict[str, Any] = {"mode": "hf", "size": spec.name, "world_size": world,
                              "transformers_version": transformers.__version__,
                              "accelerate_version": accelerate.__version__}
    per_rank: dict[str, Any] = {}
    fsdp_config = {"version": 2, "transformer_layer_cls_to_wrap": [LAYER_CLASS], "reshard_after_forward": True,
                   "state_dict_type": "FULL_STATE_DICT"}
    result["hf_arguments"] = {"fsdp": True, "fsdp_config": dict(fsdp_config), "use_cpu": True,
                              "optim": "adamw_torch_fused" if FUSED_ADAMW else "adamw_torch"}
    tmp = tempfile.mkdtemp(prefix="bench_hf_")
    trainer = None
    try:
        args = HFArguments(
            output_dir=tmp, per_device_train_batch_size=spec.per_device_batch, max_steps=total,
            learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
            lr_scheduler_type="linear", warmup_steps=0, seed=SEED, logging_steps=10**9, save_strategy="no",
            report_to="none", disable_tqdm=True, use_cpu=True, fsdp=True, fsdp_config=fsdp_config,
            optim="adamw_torch_fused" if FUSED_ADAMW else "adamw_torch", dataloader_num_workers=0,
            dataloader_drop_last=True)
        trainer = HFTrainer(model=build_model(spec), args=args, train_dataset=samples, callbacks=[Timing()])
        output = trainer.train()
        tokens = spec.per_device_batch * spec.seq_len * world
        result["timing"] = summarize_steps(timer.durations(), timer.cpu_durations(), cli.warmup, tokens)
        result["rusage_per_step_rank0"] = timer.usage_per_step(cli.warmup)
        result["global_steps"] = trainer.state.global_step
        result["mean_loss"] = output.training_loss
    except Exception as err:  # record what HF did and go on (its CPU path is part of what we measure)
        result["error"] = f"{type(err).__name__}: {err}"[:2000]
        result["traceback_tail"] = traceback.format_exc()[-3000:]
        print(f"[rank {rank}] hf failed: {result['error']}", file=sys.stderr, flush=True)
    if trainer is not None:
        accel = getattr(trainer, "accelerator", None)
        facts = {
            "model_wrapped_type": type(trainer.model_wrapped).__name__,
            "model_type": type(trainer.model).__name__,
            "accelerate_distributed_type": str(getattr(getattr(accel, "state", None), "distributed_type", None)),
            "is_fsdp_enabled": bool(getattr(trainer, "is_fsdp_enabled", False)),
            "ddp_find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
            **sharding_facts(trainer.model_wrapped),
        }
        result["what_hf_did"] = facts
        per_rank["sharding"] = facts
        per_rank["param_bytes"] = param_bytes(trainer.model_wrapped)
        per_rank["grad_bytes"] = holder["grad_bytes"]
        if trainer.optimizer is not None:
            inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            per_rank["optimizer_state_bytes"] = optimizer_state_bytes(inner)
    if "error" in result:
        # a failure may be on one rank only; do not enter collectives that could hang
        if rank == 0:
            result["per_rank"] = [{**per_rank, **baseline.report()}]
            cli.out.write_text(json.dumps(result, indent=1))
        return
    finish(result, baseline, cli.out, per_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", required=True,
                        choices=["raw", "raw_head", *SHARDTRAIN_VARIANTS, "hf", "single", "state"],
                        help="raw_head: raw plus shardtrain's extra FSDP unit (final norm + lm_head)")
    parser.add_argument("--size", choices=sorted(SIZES), help="model size (raw / shardtrain / hf)")
    parser.add_argument("--sizes", default="tiny,50m", help="comma list (single / state)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--submeshes", default=None,
                        help="state: comma list of N; measure each on sub-meshes of N ranks of this world")
    parser.add_argument("--profile", default="none", choices=["none", "torch", "cprofile", "stages"])
    parser.add_argument("--fsdp-json", default="{}", help="shardtrain modes: fsdp_config keys on top of the mode's")
    parser.add_argument("--out", type=Path, required=True)
    cli = parser.parse_args()
    cli.head_unit = cli.mode == "raw_head"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.perf_counter()
    if cli.mode in ("single", "state"):
        specs = [SIZES[name] for name in cli.sizes.split(",") if name]
        (run_single if cli.mode == "single" else run_state)(cli, specs)
    else:
        if cli.size is None:
            parser.error(f"--mode {cli.mode} needs --size")
        runners = {"raw": run_raw, "raw_head": run_raw, "hf": run_hf,
                   **dict.fromkeys(SHARDTRAIN_VARIANTS, run_shardtrain)}
        runners[cli.mode](cli, SIZES[cli.size])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    print(f"worker {cli.mode} done in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

