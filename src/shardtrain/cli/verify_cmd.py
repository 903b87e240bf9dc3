r"""`shardtrain verify`: does my own script give the same run on 1 process and on N ranks?

    shardtrain verify --cpu --layouts 2,4 --accumulation 1,2 train.py --my_flag x   # 1 process vs 2/4 ranks x 1/2
    shardtrain verify --layouts dp2xcp2,tp2 --steps 3 --tolerance 1e-4 train.py     # parallel sizes by name

Runs the script K steps (`--steps`) through its own Trainer on one process, then on each layout, all with the
global batch of the one-process run (per-device batch x accumulation, as the script sets them). Each run goes
through `shardtrain launch`, with SHARDTRAIN_VERIFY asking the script's TrainingArguments for K steps, a log entry
per step, no saving, evaluation or trackers, and an output directory of verify's own (`shardtrain.train.verify`).
It prints, per layout, the largest difference from one process in the loss, the gradient norm and the final
weights, the first step and the first parameter beyond `--tolerance`, and a verdict.

Exit status: 0 every layout equals one process within the tolerance; 1 one differs (a layout-dependent script:
usually a loss averaged per device, not over the global batch); 3 one differs and the script depends on the layout
by nature (in-batch negatives, dropout); 2 a usage error or a run that failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shardtrain.config import env as env_names
from shardtrain.errors import LaunchConfigError
from shardtrain.train.verify import DUMP_FILE, WEIGHTS_FILE

_AXES = {"dp": None, "cp": "cp_size", "tp": "tp_size", "ep": "ep_size"}


@dataclass(frozen=True, kw_only=True)
class VerifyLayout:
    """One layout to compare: its sizes by axis and its accumulation steps."""

    name: str
    sizes: dict[str, int]
    accumulation: int

    @property
    def world_size(self) -> int:
        """Processes: dp x cp x tp (expert parallelism borrows its ranks)."""
        return self.sizes.get("dp", 1) * self.sizes.get("cp", 1) * self.sizes.get("tp", 1)

    @property
    def label(self) -> str:
        """How the table names it."""
        return f"{self.name} x acc {self.accumulation}"


def parse_layouts(text: str, accumulation: list[int]) -> list[VerifyLayout]:
    """'2,dp2xcp2' x accumulation [1, 2] -> the layouts to run.

    Raises:
        LaunchConfigError: a part that is neither a rank count nor `<axis><size>` joined by `x`.
    """
    out = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        if part.isdigit():
            sizes = {"dp": int(part)}
        else:
            tokens = part.split("x")
            matches = [re.fullmatch(r"(dp|cp|tp|ep)(\d+)", token) for token in tokens]
            if not all(matches):
                raise LaunchConfigError(f"--layouts: cannot read {part!r}; write a rank count (2) or sizes by axis "
                                        f"joined by x (dp2xcp2, tp2, dp2xep2)")
            sizes = {m.group(1): int(m.group(2)) for m in matches}
        if min(sizes.values()) < 1:
            raise LaunchConfigError(f"--layouts: {part!r} has a size below 1")
        out += [VerifyLayout(name=part, sizes=sizes, accumulation=a) for a in accumulation]
    return out


def _launch(script: str, script_args: list[str], layout: VerifyLayout, request: dict, cpu: bool) -> None:
    flags = ["--num_processes", str(layout.world_size)] + (["--cpu"] if cpu else [])
    parallel = {_AXES[axis]: size for axis, size in layout.sizes.items() if _AXES[axis] and size > 1}
    if parallel:
        flags.append("--use_parallelism_config")
        for key, size in parallel.items():
            flags += [f"--parallelism_config_{key}", str(size)]
    environ = {**os.environ, env_names.VERIFY: json.dumps(request)}
    done = subprocess.run([sys.executable, "-m", "shardtrain.cli.main", "launch", *flags, script, *script_args],
                          env=environ, capture_output=True, text=True, check=False)
    dump = Path(request["dump"]) / DUMP_FILE
    if done.returncode != 0 or not dump.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise LaunchConfigError(f"the run on {layout.label} failed (exit {done.returncode}) before writing its "
                                f"figures; its last lines:\n{tail}")


def _read(directory: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return json.loads((directory / DUMP_FILE).read_text()), load_file(str(directory / WEIGHTS_FILE))


def compare(reference: tuple[dict, dict], run: tuple[dict, dict], tolerance: float) -> dict:
    """The differences of one run from the one-process run: largest per figure, first step and parameter beyond
    `tolerance`."""
    (ref, ref_w), (got, got_w) = reference, run
    rows = list(zip(ref["steps"], ref["losses"], ref["grad_norms"], got["losses"], got["grad_norms"],
                    strict=False))
    loss_diff = [abs(b - a) for _, a, _, b, _ in rows]
    norm_diff = [abs(b - a) if a is not None and b is not None else 0.0 for _, _, a, _, b in rows]
    first_step = next((step for (step, *_), dl, dn in zip(rows, loss_diff, norm_diff, strict=True)
                       if not (dl <= tolerance and dn <= tolerance)), None)
    if len(got["losses"]) != len(ref["losses"]) and first_step is None:
        first_step = min(len(got["losses"]), len(ref["losses"])) + 1
    weight_diff, first_param = 0.0, None
    for name in ref["parameters"]:
        if name not in got_w or got_w[name].shape != ref_w[name].shape:
            first_param, weight_diff = first_param or name, math.inf
            continue
        diff = float((got_w[name] - ref_w[name]).abs().max()) if ref_w[name].numel() else 0.0
        weight_diff = max(weight_diff, diff if diff == diff else math.inf)
        if first_param is None and not diff <= tolerance:
            first_param = name
    return {"loss": max(loss_diff, default=0.0), "grad_norm": max(norm_diff, default=0.0), "weights": weight_diff,
            "step1_loss": loss_diff[0] if loss_diff else 0.0,
            "first_step": first_step, "first_parameter": first_param,
            "equal": first_step is None and first_param is None}


def _format_table(reference: dict, results: list[tuple[VerifyLayout, dict]]) -> str:
    lines = [f"{'layout':<24} {'batch':<14} {'max |dloss|':>12} {'max |dgrad|':>12} {'max |dweight|':>14}  "
             f"{'first step':>10}  first parameter",
             f"{'1 process (reference)':<24} {reference['per_device_train_batch_size']} x "
             f"{reference['gradient_accumulation_steps']:<10} {'-':>12} {'-':>12} {'-':>14}  {'-':>10}  -"]
    for layout, r in results:
        batch = f"{r['per_device']} x {layout.accumulation}"
        lines.append(f"{layout.label:<24} {batch:<14} {r['loss']:>12.3g} {r['grad_norm']:>12.3g} "
                     f"{r['weights']:>14.3g}  {str(r['first_step'] or '-'):>10}  {r['first_parameter'] or '-'}")
    return "\n".join(lines)


def run_verify(args: argparse.Namespace) -> int:
    """Entry of `shardtrain verify` (prints the table and the verdict; the exit status is in the docstring)."""
    if not Path(args.script).is_file():
        raise LaunchConfigError(f"script {args.script!r} does not exist; pass the path of your training script")
    accumulation = [int(a) for a in str(args.accumulation).split(",") if a.strip()]
    if not accumulation or min(accumulation) < 1:
        raise LaunchConfigError(f"--accumulation {args.accumulation!r}: give steps >= 1, e.g. 1,2")
    layouts = parse_layouts(args.layouts, accumulation)
    if args.keep:
        return _verify(args, layouts, Path(args.keep), kept=True)
    # without --keep the runs' dumps (every run's final weights among them) go when verify ends, however it ends
    with tempfile.TemporaryDirectory(prefix="shardtrain-verify-") as work:
        return _verify(args, layouts, Path(work), kept=False)


def _verify(args: argparse.Namespace, layouts: list[VerifyLayout], work: Path, kept: bool) -> int:
    script_args = list(args.script_args)
    one = VerifyLayout(name="1 process", sizes={"dp": 1}, accumulation=1)
    where = f"runs in {work}" if kept else "runs in a temporary directory (--keep DIR keeps them)"
    print(f"shardtrain verify: {args.script}, {args.steps} steps, tolerance {args.tolerance:g}; {where}", flush=True)
    request = {"dump": str(work / "reference"), "max_steps": args.steps}
    _launch(args.script, script_args, one, request, args.cpu)
    reference = _read(work / "reference")
    ref = reference[0]
    global_batch = ref["per_device_train_batch_size"] * ref["gradient_accumulation_steps"] * ref["data_ranks"]
    results = []
    for i, layout in enumerate(layouts):
        data_ranks = layout.sizes.get("dp", 1)
        per_device, rest = divmod(global_batch, data_ranks * layout.accumulation)
        if rest or per_device < 1:
            raise LaunchConfigError(f"{layout.label}: the global batch of {global_batch} samples does not split "
                                    f"into {data_ranks} data-parallel ranks x {layout.accumulation} accumulation "
                                    f"steps; choose layouts whose product divides {global_batch}")
        request = {"dump": str(work / f"run{i}"), "max_steps": args.steps, "per_device_train_batch_size": per_device,
                   "gradient_accumulation_steps": layout.accumulation}
        print(f"  running {layout.label} ({layout.world_size} processes, {per_device} samples per device)...",
              flush=True)
        _launch(args.script, script_args, layout, request, args.cpu)
        results.append((layout, {**compare(reference, _read(work / f"run{i}"), args.tolerance),
                                 "per_device": per_device}))
    print(_format_table(ref, results))
    differing = [(layout, r) for layout, r in results if not r["equal"]]
    (work / "summary.json").write_text(json.dumps({"reference": ref["layout"], "global_batch": global_batch,
                                                   "runs": [{"layout": layout.label, **r} for layout, r in results]},
                                                  indent=1, default=str))
    if not differing:
        print(f"verdict: same run - every layout equals one process within {args.tolerance:g} (global batch "
              f"{global_batch})")
        return 0
    layout, first = differing[0]
    where = f"step {first['first_step']}" if first["first_step"] else f"parameter {first['first_parameter']}"
    size = max(first["loss"], first["grad_norm"], first["weights"])
    if ref.get("layout_dependent"):
        print(f"verdict: layout-dependent by nature - {ref['layout_dependent']}. {layout.label} differs from one "
              f"process from {where} (by up to {size:.3g}); that follows from the model or the loss, not from a bug")
        return 3
    evidence, causes = diagnose(results, args.tolerance)
    print("what the numbers show:")
    for line in evidence:
        print(f"  - {line}")
    print("candidate causes, most likely first:")
    for i, cause in enumerate(causes, 1):
        print(f"  {i}. {CAUSES[cause]}")
    print(f"verdict: DIFFERS - {layout.label} leaves one process at {where}, by up to {size:.3g} (tolerance "
          f"{args.tolerance:g}); first parameter beyond it: {first['first_parameter'] or 'none'}; most likely: "
          f"{cause_name(causes[0])}")
    return 1


CAUSES = {
    "normalisation": "normalisation: a loss averaged per device or per micro-batch instead of over the global "
                     "batch (return the token sum / Trainer.compute_loss's num_items_in_batch)",
    "rank": "rank-dependent code: a term that reads the rank or the number of processes, or data a rank builds for "
            "itself",
    "randomness": "unseeded randomness: a draw that does not come from the Trainer's seed (masks, augmentation, "
                  "sampling in the loss)",
    "data order": "data order: a sampler or dataset order of the script's own that depends on the layout",
}


def cause_name(cause: str) -> str:
    return CAUSES[cause].split(":")[0]


def diagnose(results: list[tuple[VerifyLayout, dict]], tolerance: float) -> tuple[list[str], list[str]]:
    """What the differing runs show, and the candidate causes ordered by it: whether step 1's loss already differs
    (before any update), whether the difference changes with accumulation at the same layout (a per-micro-batch
    mean does, a rank-dependent term does not), whether the weights follow, where the first parameter is."""
    evidence: list[str] = []
    causes = list(CAUSES)
    differing = [(layout, r) for layout, r in results if not r["equal"]]
    layout, first = differing[0]
    if first["step1_loss"] > tolerance:
        evidence.append(f"step 1's loss already differs ({first['step1_loss']:.3g} on {layout.label}), before any "
                        "update: the loss is computed differently, not the updates")
    elif first["first_step"]:
        evidence.append(f"step 1's loss is the same; the runs part at step {first['first_step']}, after updates: the "
                        "gradients (or the steps' randomness) differ")
        causes = ["normalisation", "randomness", "rank", "data order"]
    by_sizes: dict[str, list[tuple[VerifyLayout, dict]]] = {}
    for run_layout, r in results:
        by_sizes.setdefault(run_layout.name, []).append((run_layout, r))
    for name, runs in by_sizes.items():
        if len(runs) < 2 or all(r["step1_loss"] <= tolerance for _, r in runs):
            continue
        step1 = ", ".join(f"acc {run_layout.accumulation}: {r['step1_loss']:.3g}" for run_layout, r in runs)
        spread = max(r["step1_loss"] for _, r in runs) - min(r["step1_loss"] for _, r in runs)
        if spread > max(tolerance, 1e-3 * max(r["step1_loss"] for _, r in runs)):
            evidence.append(f"on {name} the step-1 difference changes with accumulation ({step1}): a loss "
                            "averaged per micro-batch does that")
            causes = ["normalisation", *[c for c in causes if c != "normalisation"]]
        else:
            evidence.append(f"on {name} the step-1 difference does not change with accumulation ({step1}): a "
                            "per-micro-batch mean would change it; a term that depends on the rank does not")
            causes = ["rank", *[c for c in causes if c != "rank"]]
    if first["weights"] <= tolerance:
        evidence.append("the final weights agree: the difference is in the reported loss only, a term that does "
                        "not reach the gradients")
    elif first["first_parameter"]:
        evidence.append(f"the first parameter beyond the tolerance is {first['first_parameter']} (by up to "
                        f"{first['weights']:.3g})")
    return evidence, causes


def add_verify_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `verify`."""
    p = subparsers.add_parser("verify", help="compare your script on 1 process and on N ranks, step by step",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
    p.add_argument("--layouts", default="2", help="rank counts and/or sizes by axis: 2,4,dp2xcp2,tp2 (default 2)")
    p.add_argument("--accumulation", default="1", help="accumulation steps to try with each layout: 1,2 "
                                                       "(default 1)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (default 5)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest difference allowed (default 1e-5)")
    p.add_argument("--cpu", action="store_true", help="run every layout on CPU (gloo)")
    p.add_argument("--keep", help="directory for the runs' figures, kept (default: a temporary directory, removed "
                                  "at the end)")
    p.add_argument("script", help="your training script (.py), run through its own Trainer")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run_verify)
