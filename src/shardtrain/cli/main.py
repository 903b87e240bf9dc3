"""`shardtrain` entry point: subcommands config / launch / merge / report / env / plan / verify / lighthouse.

    shardtrain config                                  # write $SHARDTRAIN_HOME/default_config.yaml
    shardtrain launch [flags] train.py [script args]   # run on N processes / M machines
    shardtrain merge CHECKPOINT_DIR OUTPUT_DIR         # sharded checkpoint -> safetensors
    shardtrain merge CKPT OUT --merge-lora --base DIR  # LoRA checkpoint + its base -> merged model
    shardtrain merge --hf-checkpoint CKPT OUT/checkpoint-N  # -> a checkpoint transformers' Trainer resumes
    shardtrain report OUTPUT_DIR                       # report.png from OUTPUT_DIR/metrics.jsonl
    shardtrain env                                     # versions, backends, devices, config
    shardtrain --version
    shardtrain plan config.json --world-size 8 --device-memory 80GiB   # will it fit? memory + step time
    shardtrain verify --cpu --layouts 2,4 train.py     # your script: 1 process vs N ranks, step by step
    shardtrain lighthouse --port 29510                 # torchft's lighthouse for replica groups
    python -m shardtrain.cli.main ...                  # same, without the console script

Exit codes: 0 ok, 1 the launched script failed, 2 a usage/config error (message `error: ...` on stderr).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from shardtrain.cli.config_cmd import add_config_parser
from shardtrain.cli.env_cmd import add_env_parser
from shardtrain.cli.launch import add_launch_parser, normalize_fsdp_flag
from shardtrain.cli.lighthouse_cmd import add_lighthouse_parser
from shardtrain.cli.plan_cmd import add_plan_parser
from shardtrain.cli.verify_cmd import add_verify_parser
from shardtrain.errors import FSDPConfigError, LaunchConfigError


def run_merge(args: argparse.Namespace) -> int:
    """Entry of `shardtrain merge`: `shardtrain.checkpoint.merge.merge_checkpoint` (imported lazily)."""
    from shardtrain.checkpoint.merge import merge_checkpoint
    from shardtrain.errors import CheckpointError

    try:
        if args.merge_lora != (args.base is not None):
            raise ValueError("--merge-lora and --base DIR go together: the base model the adapters were trained on")
        if args.hf_checkpoint and args.merge_lora:
            raise ValueError("--hf-checkpoint exports a whole model's training state; drop --merge-lora / --base")
        if args.hf_checkpoint:
            from shardtrain.checkpoint.hf_checkpoint import export_hf_checkpoint

            export_hf_checkpoint(args.checkpoint_dir, args.output_dir)
        else:
            merge_checkpoint(args.checkpoint_dir, args.output_dir, lora_base=args.base)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"Merged {args.checkpoint_dir} into {args.output_dir}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    """Entry of `shardtrain report`: `shardtrain.train.metrics.chart` (imported lazily)."""
    from shardtrain.train.metrics.chart import main as report_main

    return report_main([args.output_dir, *(["--out", args.out] if args.out else [])])


def build_parser() -> argparse.ArgumentParser:
    """The `shardtrain` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="shardtrain", allow_abbrev=False,
        description="FSDP2 training: config, launch, merge, report, env, plan, verify, lighthouse.")
    from shardtrain import __version__

    parser.add_argument("--version", action="version", version=f"shardtrain {__version__}")
    subparsers = parser.add_subparsers(dest="command",
                                       metavar="{config,launch,merge,report,env,plan,verify,lighthouse}")
    add_config_parser(subparsers)
    add_launch_parser(subparsers)
    merge = subparsers.add_parser(
        "merge", help="turn a sharded checkpoint into safetensors (no distributed setup)", allow_abbrev=False
    )
    merge.add_argument("checkpoint_dir", help="checkpoint directory (e.g. output/checkpoint-500)")
    merge.add_argument("output_dir", help="where the merged safetensors model goes")
    merge.add_argument("--merge-lora", action="store_true", help="a LoRA checkpoint: merge its adapters into --base")
    merge.add_argument("--base", help="with --merge-lora: the base model directory the adapters were trained on")
    merge.add_argument("--hf-checkpoint", action="store_true",
                       help="write transformers' checkpoint layout (model, optimizer.pt, scheduler.pt, rng_state.pth, "
                            "trainer_state.json): transformers' one-process Trainer resumes OUTPUT_DIR with its "
                            "optimizer; name it checkpoint-<step>")
    merge.set_defaults(func=run_merge)
    report = subparsers.add_parser("report", help="draw report.png (loss, learning rate, grad norm, throughput "
                                                  "and memory) from a run's metrics.jsonl", allow_abbrev=False)
    report.add_argument("output_dir", help="the run's output_dir (holds metrics.jsonl)")
    report.add_argument("--out", help="PNG path (default: OUTPUT_DIR/report.png)")
    report.set_defaults(func=run_report)
    add_env_parser(subparsers)
    add_plan_parser(subparsers)
    add_verify_parser(subparsers)
    add_lighthouse_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (argparse's own errors included).

    Args:
        argv: arguments without the program name; `sys.argv[1:]` when None.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        argv = ["launch", *normalize_fsdp_flag(argv[1:])]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except (LaunchConfigError, FSDPConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\naborted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardtrain plan ... | head`: the reader has gone; end as a command killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's own flush would fail again)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
