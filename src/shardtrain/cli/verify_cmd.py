r"""`shardtrain verify`: does my own script give the same run on 1 process and on N ranks?

    shardtrain verify --cpu --layouts 2,4 --accumulation 1,2 train.py --my_flag x   # 1 process vs 2/4 ranks x 1/2
    shardtrain verify --layouts dp2xcp2,tp2 --steps 3 --tolerance 1e-4 train.py     # parallel sizes by name

Runs the script K steps (`--steps`) through its own Trainer on one process, then on each layout, all with the
global batch of the one-process run (per-device batch x accumulation, as the script sets them). Each run goes
through `shardtrain launch`, with SHARDTRAIN_VERIFY asking the script's TrainingArguments for K steps, a log entry
per step, no saving, evaluation or trackers, and an output directory of verify's own (`shardtrain.train.verify`).
It prints, per layout, the largest difference from one process in the loss, the gradient norm and the final
weights, the first step and the first parameter beyond `--tolerance`, and a verdict.

The tolerance of each figure (loss, gradient norm, weights) is `--tolerance` or, where larger, 10x what the run's
own rounding gives: the one-process run again with each micro-batch's samples in reverse order (an adaptive
optimizer turns the rounding of near-zero gradients into weight differences far above it). Dropout is off in every
run (each rank draws its own masks). A differing layout's cause is read from the evidence the runs record: the
samples of each step (data, data order), the initial weights and each rank's random state at the first step
(seeds), the step-1 difference against accumulation (normalisation, a rank-dependent term).

Exit status: 0 every layout equals one process within the tolerances; 1 one differs (a layout-dependent script:
its most likely cause named with its evidence); 3 one differs and the script depends on the layout by nature
(in-batch negatives); 2 a usage error or a run that failed.
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


@dataclass(frozen=True)
class Tolerances:
    """The largest differences a run may show per figure: `--tolerance`, or more where the run's own rounding
    (the one-process run with each micro-batch's samples in reverse order) is larger: `ROUNDING_MARGIN` times it."""

    loss: float
    grad_norm: float
    weights: float

    @classmethod
    def from_rounding(cls, floor: float, rounding: dict) -> Tolerances:
        return cls(*(max(floor, ROUNDING_MARGIN * rounding[k]) for k in ("loss", "grad_norm", "weights")))


ROUNDING_MARGIN = 10.0


def compare(reference: tuple[dict, dict], run: tuple[dict, dict], tolerance: float | Tolerances) -> dict:
    """The differences of one run from the one-process run: largest per figure, first step and parameter beyond
    the tolerance (one number for every figure, or `Tolerances`)."""
    tol = tolerance if isinstance(tolerance, Tolerances) else Tolerances(tolerance, tolerance, tolerance)
    (ref, ref_w), (got, got_w) = reference, run
    rows = list(zip(ref["steps"], ref["losses"], ref["grad_norms"], got["losses"], got["grad_norms"],
                    strict=False))
    loss_diff = [abs(b - a) for _, a, _, b, _ in rows]
    norm_diff = [abs(b - a) if a is not None and b is not None else 0.0 for _, _, a, _, b in rows]
    first_step = next((step for (step, *_), dl, dn in zip(rows, loss_diff, norm_diff, strict=True)
                       if not (dl <= tol.loss and dn <= tol.grad_norm)), None)
    if len(got["losses"]) != len(ref["losses"]) and first_step is None:
        first_step = min(len(got["losses"]), len(ref["losses"])) + 1
    weight_diff, first_param = 0.0, None
    for name in ref["parameters"]:
        if name not in got_w or got_w[name].shape != ref_w[name].shape:
            first_param, weight_diff = first_param or name, math.inf
            continue
        diff = float((got_w[name] - ref_w[name]).abs().max()) if ref_w[name].numel() else 0.0
        weight_diff = max(weight_diff, diff if diff == diff else math.inf)
        if first_param is None and not diff <= tol.weights:
            first_param = name
    evidence = evidence_of(ref, got)  # (a seed per rank is a difference even where dropout, off here, hides it)
    return {"loss": max(loss_diff, default=0.0), "grad_norm": max(norm_diff, default=0.0), "weights": weight_diff,
            "step1_loss": loss_diff[0] if loss_diff else 0.0,
            "first_step": first_step, "first_parameter": first_param,
            "equal": first_step is None and first_param is None and not evidence, "evidence": evidence}


def evidence_of(ref: dict, got: dict) -> dict:
    """What separates the causes, from the runs' probes: the samples of each step, the initial weights, each
    rank's random state at the first step."""
    found: dict = {}
    if ref.get("samples") and got.get("samples"):
        steps = sorted(set(ref["samples"]) | set(got["samples"]), key=int)
        differ = [s for s in steps if sorted(ref["samples"].get(s, [])) != sorted(got["samples"].get(s, []))]
        if differ:
            mine, theirs = ref["samples"].get(differ[0], []), got["samples"].get(differ[0], [])
            others = len([r for r in theirs if r not in set(mine)])
            every_ref = sorted(r for s in steps for r in ref["samples"].get(s, []))
            every_got = sorted(r for s in steps for r in got["samples"].get(s, []))
            found["data"] = {"step": int(differ[0]), "other_rows": others, "rows": len(mine),
                             "repeated_rows": (len(theirs) - len(set(theirs))) - (len(mine) - len(set(mine))),
                             "same_samples_overall": every_ref == every_got}
    if ref.get("initial_weights") and got.get("initial_weights") and ref["initial_weights"] != got["initial_weights"]:
        found["initial_weights"] = True
    if ref.get("rng_at_start") and got.get("rng_at_start"):
        ranks = [r for r, state in enumerate(got["rng_at_start"]) if state != ref["rng_at_start"][0]]
        if ranks:
            found["rng_ranks"] = ranks
    return found


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
    print("  running 1 process (the reference)...", flush=True)
    _launch(args.script, script_args, one, {"dump": str(work / "reference"), "max_steps": args.steps}, args.cpu)
    reference = _read(work / "reference")
    print("  running 1 process again, each micro-batch's samples in reverse order (the run's own rounding)...",
          flush=True)
    _launch(args.script, script_args, one, {"dump": str(work / "rounding"), "max_steps": args.steps,
                                            "reverse_rows": True}, args.cpu)
    rounding = compare(reference, _read(work / "rounding"), args.tolerance)
    tol = Tolerances.from_rounding(args.tolerance, rounding)
    ref = reference[0]
    print(f"  rounding: the reordered run differs by {rounding['loss']:.2g} (loss), {rounding['grad_norm']:.2g} "
          f"(grad norm), {rounding['weights']:.2g} (weights); tolerances {tol.loss:.2g}, {tol.grad_norm:.2g}, "
          f"{tol.weights:.2g} (--tolerance, or {ROUNDING_MARGIN:g}x the rounding where larger)", flush=True)
    if ref.get("dropout_off"):
        print(f"  dropout off in every run ({ref['dropout_off']}): each rank draws its own masks, which no other "
              "layout can reproduce", flush=True)
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
        results.append((layout, {**compare(reference, _read(work / f"run{i}"), tol), "per_device": per_device}))
    print(_format_table(ref, results))
    differing = [(layout, r) for layout, r in results if not r["equal"]]
    (work / "summary.json").write_text(json.dumps({"reference": ref["layout"], "global_batch": global_batch,
                                                   "rounding": rounding, "tolerances": vars(tol),
                                                   "runs": [{"layout": layout.label, **r} for layout, r in results]},
                                                  indent=1, default=str))
    if not differing:
        print(f"verdict: same run - every layout equals one process within the tolerances (global batch "
              f"{global_batch})")
        return 0
    layout, first = differing[0]
    where = f"step {first['first_step']}" if first["first_step"] else f"parameter {first['first_parameter']}" \
        if first["first_parameter"] else "its first step's state (the numbers agree with dropout off)"
    size = max(first["loss"], first["grad_norm"], first["weights"])
    if ref.get("layout_dependent"):
        print(f"verdict: layout-dependent by nature - {ref['layout_dependent']}. {layout.label} differs from one "
              f"process from {where} (by up to {size:.3g}); that follows from the model or the loss, not from a bug")
        return 3
    evidence, causes = diagnose(results, tol.loss)
    print("what the numbers show:")
    for line in evidence:
        print(f"  - {line}")
    print("candidate causes, most likely first:")
    for i, cause in enumerate(causes, 1):
        print(f"  {i}. {CAUSES[cause]}")
    print(f"verdict: DIFFERS - {layout.label} leaves one process at {where}, by up to {size:.3g} (tolerance "
          f"{tol.loss:.2g}); first parameter beyond it: {first['first_parameter'] or 'none'}; most likely: "
          f"{cause_name(causes[0])}")
    return 1


CAUSES = {
    "data": "data: the ranks train other samples than one process (a dataset a rank builds, filters or shards "
            "for itself: build it the same on every rank and let the Trainer split it)",
    "data order": "data order: the same samples, grouped into steps differently (a sampler of the script's own "
                  "that depends on the rank or the epoch: leave sampling to the Trainer)",
    "sampler": "sampler: a loader of the script's own that does not split the data over the ranks (a "
               "DistributedSampler, its set_epoch, forgotten): leave loading to the Trainer, or shard by rank",
    "seeds": "seeds: a random seed that depends on the rank (the model's initialisation, dropout, sampling): "
             "seed every rank alike (the Trainer's seed does)",
    "normalisation": "normalisation: a loss averaged per device or per micro-batch instead of over the global "
                     "batch (return the token sum / Trainer.compute_loss's num_items_in_batch)",
    "rank": "rank-dependent code: a term that reads the rank or the number of processes",
    "randomness": "unseeded randomness: a draw that does not come from the Trainer's seed (masks, augmentation, "
                  "sampling in the loss)",
}


def cause_name(cause: str) -> str:
    return CAUSES[cause].split(":")[0]


def _first(causes: list[str], cause: str) -> list[str]:
    return [cause, *[c for c in causes if c != cause]]


def diagnose(results: list[tuple[VerifyLayout, dict]], tolerance: float) -> tuple[list[str], list[str]]:
    """What the differing runs show, and the candidate causes ordered by it, strongest evidence first: the
    samples of each step (data, data order), the initial weights and each rank's random state (seeds); then the
    numbers: whether step 1's loss already differs (before any update), whether that difference changes with
    accumulation at the same layout (a per-micro-batch mean does, a rank-dependent term does not), whether the
    weights follow."""
    evidence: list[str] = []
    causes = ["normalisation", "rank", "randomness", "seeds", "data order", "data", "sampler"]
    differing = [(layout, r) for layout, r in results if not r["equal"]]
    layout, first = differing[0]
    found = first.get("evidence", {})
    decided = None
    if "data" in found:
        d = found["data"]
        if d["repeated_rows"] > 0:
            evidence.append(f"step {d['step']} on {layout.label} trains {d['repeated_rows']} of its {d['rows']} "
                            "samples twice, where one process trains them once: every rank read the same batches")
            decided = "sampler"
        elif d["same_samples_overall"]:
            evidence.append(f"step {d['step']} on {layout.label} groups other samples than one process (the same "
                            "samples over the run): the order of the data depends on the layout")
            decided = "data order"
        else:
            evidence.append(f"step {d['step']} on {layout.label} trained {d['other_rows']} of {d['rows']} samples "
                            "that one process never saw: the data itself depends on the rank")
            decided = "data"
    if "initial_weights" in found:
        evidence.append(f"the initial weights on {layout.label} differ from one process's, before any step: the "
                        "model is initialised differently (a seed that depends on the rank)")
        decided = decided or "seeds"
    if "rng_ranks" in found:
        ranks = ", ".join(map(str, found["rng_ranks"]))
        evidence.append(f"the random state at the first step differs from one process's on rank(s) {ranks}: a "
                        "seed set per rank (dropout, sampling draw from it)")
        decided = decided or "seeds"
    if first["step1_loss"] > tolerance:
        evidence.append(f"step 1's loss already differs ({first['step1_loss']:.3g} on {layout.label}), before any "
                        "update: the loss is computed differently, not the updates")
    elif first["first_step"]:
        evidence.append(f"step 1's loss is the same; the runs part at step {first['first_step']}, after updates: the "
                        "gradients (or the steps' randomness) differ")
    by_sizes: dict[str, list[tuple[VerifyLayout, dict]]] = {}
    for run_layout, r in results:
        by_sizes.setdefault(run_layout.name, []).append((run_layout, r))
    for name, runs in by_sizes.items():
        if decided or len(runs) < 2 or all(r["step1_loss"] <= tolerance for _, r in runs):
            continue
        step1 = ", ".join(f"acc {run_layout.accumulation}: {r['step1_loss']:.3g}" for run_layout, r in runs)
        spread = max(r["step1_loss"] for _, r in runs) - min(r["step1_loss"] for _, r in runs)
        if spread > max(tolerance, 1e-3 * max(r["step1_loss"] for _, r in runs)):
            evidence.append(f"on {name} the step-1 difference changes with accumulation ({step1}): a loss "
                            "averaged per micro-batch does that")
            causes = _first(causes, "normalisation")
        else:
            evidence.append(f"on {name} the step-1 difference does not change with accumulation ({step1}): a "
                            "per-micro-batch mean would change it; a term that depends on the rank does not")
            causes = _first(causes, "rank")
    if decided:
        causes = _first(causes, decided)
    elif not found and first["step1_loss"] <= tolerance and first["first_step"]:
        causes = _first(_first(causes, "randomness"), "normalisation")
    if first["first_step"] is None and first["first_parameter"] is None:
        evidence.append("the losses, gradient norms and weights agree (dropout off): the evidence above is the "
                        "difference")
    elif first["first_parameter"] is None:
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
