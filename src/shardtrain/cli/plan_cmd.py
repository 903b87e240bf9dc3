"""`shardtrain plan`: will it fit? Per-rank memory and step time of a Trainer run, predicted from a traced step.

The model is built on the meta device from its config (nothing is downloaded or allocated) and one training step
is traced under the layout: the peak memory per rank, what holds it, and the FLOPs and collective bytes that give
the step time on the target device.

examples:
  shardtrain plan config.json --world-size 8 --batch 4 --seq-len 2048 --bf16 --accelerator h100-sxm
  shardtrain plan MODEL_DIR --fsdp-config fsdp.json --dp-shard 4 --dp-replicate 2 --activation-checkpointing --json
  shardtrain plan config.json --world-size 64 --bf16 --target cuda --device-memory 80GiB --tflops 400 --link-gbps 50
  shardtrain plan config.json --world-size 2 --target cpu          # this machine's CPU, rates measured here
"""

from __future__ import annotations

import argparse
import json
import sys

from shardtrain.errors import UserError
from shardtrain.parallel.pipeline_settings import SCHEDULES


def _on_off(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def _bool_flag(parser: argparse.ArgumentParser, name: str, help_: str) -> None:
    """`--name` (true), `--name false`, or unset (the fsdp_config's value)."""
    parser.add_argument(f"--{name}", nargs="?", const=True, default=None, type=_on_off, metavar="BOOL", help=help_)


def _take_underscores(parser: argparse.ArgumentParser) -> None:
    """Each `--two-words` flag is also `--two_words`: the spelling of `shardtrain launch` and `config`."""
    add = parser.add_argument

    def add_argument(*names: str, **kwargs):
        spelled = ["--" + n[2:].replace("-", "_") for n in names if n.startswith("--") and "-" in n[2:]]
        return add(*names, *spelled, **kwargs)

    parser.add_argument = add_argument


def _ac_value(text: str) -> bool | str:
    from shardtrain.config.fsdp_config import parse_activation_checkpointing
    from shardtrain.errors import FSDPConfigError

    try:
        return parse_activation_checkpointing(text)
    except FSDPConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `shardtrain plan` on the top-level subparsers."""
    from shardtrain.plan.accelerators import table

    plan = subparsers.add_parser(
        "plan", allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"--accelerator NAME (datasheet peaks, dense; a real step reaches a fraction of them):\n{table()}",
        help="predict per-rank memory (and whether it fits) and step time of a training run; nothing is downloaded")
    _take_underscores(plan)
    plan.add_argument("model", help="a transformers config.json, or a model directory that holds one")
    plan.add_argument("--fsdp-config", help="fsdp_config JSON file or JSON text (the Trainer's keys)")
    plan.add_argument("--world-size", type=int, help="ranks (default: the product of the sizes given, else 1)")
    plan.add_argument("--dp-shard", type=int, help="ranks that shard the model (default: the rest)")
    plan.add_argument("--dp-replicate", type=int, help="replicas of the shard groups (HSDP)")
    plan.add_argument("--cp", type=int, default=1, help="context-parallel size (splits each sequence)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the model's own tp plan)")
    plan.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; the token exchange "
                      "assumes uniform routing)")
    plan.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (the model's own pp plan)")
    plan.add_argument("--pp-schedule", default="1F1B", metavar="SCHEDULE",
                      help=f"pipeline schedule, one of torch's: {', '.join(SCHEDULES)} (default 1F1B)")
    plan.add_argument("--pp-microbatches", type=int, help="pipeline microbatches (default: pp)")
    plan.add_argument("--batch", type=int, default=1, help="per-device batch (samples)")
    plan.add_argument("--seq-len", type=int, default=2048, help="sequence length in tokens")
    plan.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (micro-batches per step)")
    plan.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    plan.add_argument("--activation-checkpointing", nargs="?", const=True, default=None, type=_ac_value,
                      metavar="MODE", help="override fsdp_config activation_checkpointing: true / full (the flag "
                      "alone), selective, or false / none")
    _bool_flag(plan, "cpu-offload", "override fsdp_config cpu_offload")
    _bool_flag(plan, "reshard-after-forward", "override fsdp_config reshard_after_forward")
    plan.add_argument("--optimizer", default="adamw_torch_fused",
                      help="the optimizer the planner models: adamw_torch_fused (default) or adamw_torch; the Trainer "
                      "also runs sgd, adagrad and rmsprop, whose state is at most AdamW's (plan them as adamw_torch "
                      "for a bound)")
    plan.add_argument("--lora-rank", type=int, default=0, help="LoRA rank: adapters on every linear but the head")
    plan.add_argument("--loss-chunk-size", metavar="TOKENS|auto",
                      help="as TrainingArguments.loss_chunk_size: LM head + cross entropy that many tokens at a time")
    plan.add_argument("--device-memory", help="memory of one device, e.g. 80GiB: does it fit, and what would")
    plan.add_argument("--accelerator", metavar="NAME",
                      help="the GPU the run trains on, from the table below: its memory, peak rate and link "
                      "(flags given beside it win)")
    plan.add_argument("--target", choices=("cuda", "cpu"),
                      help="the device kind the run trains on (default: cuda with --accelerator or "
                      "--device-memory, or when a GPU is visible here; else cpu: offloaded state counts too)")
    plan.add_argument("--tflops", type=float, help="compute rate per device in TFLOP/s (default: the "
                      "--accelerator's datasheet peak, else measured here)")
    plan.add_argument("--mfu", type=float, default=None,
                      help="the share of that rate a real step reaches, for the second step time (default 0.4 with "
                           "a datasheet peak, 1 with a rate measured here or given)")
    plan.add_argument("--host-memory", help="host memory of one machine, e.g. 512GiB (default: this machine's)")
    plan.add_argument("--ranks-per-machine", type=int, default=None,
                      help="ranks on one machine, for the host memory it needs (default: 8, or the world size)")
    plan.add_argument("--link-gbps", type=float, help="link rate per rank in GB/s (default: a local stand-in)")
    plan.add_argument("--no-step-time", action="store_true", help="skip the step-time estimate")
    plan.add_argument("--no-what-if", action="store_true",
                      help="trace only the planned activation-checkpointing mode (one trace: faster for big models)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    plan.set_defaults(func=run_plan)
    return plan


def run_plan(args: argparse.Namespace) -> int:
    """Entry of `shardtrain plan`: `shardtrain.plan.plan` (imported lazily: it imports torch and transformers)."""
    import torch

    from shardtrain.plan import plan
    from shardtrain.plan.accelerators import accelerator
    from shardtrain.plan.step_time import DEFAULT_MFU

    try:
        device = accelerator(args.accelerator) if args.accelerator else None
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.mfu is not None and not 0 < args.mfu <= 1:
        print(f"error: --mfu {args.mfu:g}: give the share of the compute rate a step reaches, in (0, 1] "
              "(e.g. 0.4)", file=sys.stderr)
        return 2
    why = "--target"
    sources: list[str | None] = [None, None]  # where the compute and link rates come from, when given
    if args.target is None and (device is not None or args.device_memory):
        args.target, why = "cuda", f"--{'accelerator' if device is not None else 'device-memory'} names a GPU"
    elif args.target is None:
        args.target = "cuda" if torch.cuda.is_available() else "cpu"
        why = "a GPU is visible here" if args.target == "cuda" else "no GPU is visible here; --target cuda for GPUs"
    if device is not None:
        if args.target != "cuda":
            print(f"error: --accelerator {device.name} is a GPU but --target is {args.target}; drop one",
                  file=sys.stderr)
            return 2
        args.device_memory = args.device_memory or f"{device.memory_gib:g}GiB"
        precision = "bf16" if args.bf16 else "fp32"
        if args.tflops is None:
            args.tflops, sources[0] = device.tflops(precision), f"{device.name} datasheet peak, {precision}"
            args.mfu = DEFAULT_MFU if args.mfu is None else args.mfu
        if args.link_gbps is None:
            args.link_gbps, sources[1] = device.link_gbps, f"{device.name} datasheet, {device.link}"
        why += f"; {device.name}: {args.tflops:g} TFLOP/s peak, {args.link_gbps:g} GB/s"
    no_rate = args.target == "cuda" and not torch.cuda.is_available() and args.tflops is None
    if no_rate and not args.no_step_time:  # a CPU matmul says nothing of a GPU's step
        args.no_step_time = True
        why += ("; no step time: no GPU here to measure one, pass --accelerator NAME (or --tflops and "
                "--link-gbps)")
    try:
        result = plan(args.model, fsdp_config=args.fsdp_config, world_size=args.world_size,
                      dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, cp=args.cp, tp=args.tp, ep=args.ep,
                      pp=args.pp, pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches,
                      per_device_batch=args.batch, seq_len=args.seq_len, gradient_accumulation_steps=args.grad_accum,
                      bf16=args.bf16,
                      activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload,
                      reshard_after_forward=args.reshard_after_forward, optimizer=args.optimizer,
                      lora_rank=args.lora_rank, device_memory=args.device_memory, target=args.target,
                      tflops=args.tflops, link_gbps=args.link_gbps, estimate_step_time=not args.no_step_time,
                      what_if=not args.no_what_if, loss_chunk_size=args.loss_chunk_size,
                      rate_sources=(sources[0], sources[1]), mfu=args.mfu or 1.0, host_memory=args.host_memory,
                      ranks_per_machine=args.ranks_per_machine)
    except UserError as err:  # FSDPConfigError, ParallelDimsError, PlanError: the message names the fix
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"Planned for {args.target} ({why}).")
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.table())
    return 0
