"""`report.png`: four panels drawn from `metrics.jsonl` — loss (train and eval), learning rate, gradient norm,
and throughput with peak memory.

    shardtrain report OUTPUT_DIR              # draws OUTPUT_DIR/report.png from OUTPUT_DIR/metrics.jsonl
    python -m shardtrain.train.metrics.chart OUTPUT_DIR

The Trainer draws it at the end of `train()` on rank 0 when matplotlib is installed (`pip install
shardtrain[report]`). Memory is what metrics.jsonl names in `memory_kind`: the allocator's high-water mark on
GPU (`cuda_max_allocated`), the process's peak resident set on CPU (`cpu_peak_rss`), the largest over ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The entries of a metrics.jsonl (a line cut short by a crash is skipped)."""
    entries = []
    for line in Path(path).read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


def series(entries: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the entries that have `key`."""
    rows = [(e["step"], e[key]) for e in entries if key in e and isinstance(e[key], int | float)]
    return [s for s, _ in rows], [v for _, v in rows]


def skipped_steps(entries: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(steps, counts) where the step guard skipped a step: each entry whose `skipped_steps` count went up."""
    steps, counts, seen = [], [], 0
    for entry in entries:
        count = entry.get("skipped_steps")
        if isinstance(count, int) and count > seen:
            steps.append(entry["step"])
            counts.append(float(count))
            seen = count
    return steps, counts


def panel_series(entries: list[dict[str, Any]]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """What each panel plots: panel -> label -> (steps, values)."""
    return {"loss": {"train loss": series(entries, "loss"), "eval loss": series(entries, "eval_loss"),
                     "skipped step": skipped_steps(entries)},
            "learning_rate": {"learning rate": series(entries, "learning_rate")},
            "grad_norm": {"gradient norm": series(entries, "grad_norm")},
            "throughput_memory": {"tokens/s": series(entries, "tokens_per_second"),
                                  "peak memory (MiB)": series(entries, "peak_memory_mb")}}


def draw_report(metrics_file: str | Path, out: str | Path) -> Path:
    """Draw the four panels of `metrics_file` into the PNG `out`; returns `out`.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        # the object API, not pyplot: no global figure state, and no pyplot import (library code, rank 0 only)
        import matplotlib.figure  # noqa: F401
    except ImportError as err:
        raise ImportError("drawing report.png needs matplotlib: pip install 'shardtrain[report]'") from err
    out = Path(out)
    draw_figure(read_metrics(metrics_file)).savefig(out, dpi=80)
    return out


def draw_figure(entries: list[dict[str, Any]]) -> Any:
    """The report's matplotlib `Figure` for the `entries` of a metrics.jsonl."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = panel_series(entries)
    # Fixed margins, not constrained_layout: the layout engine measured every tick label twice and took half of
    # the ~0.5 CPU-s a drawing cost, paid at the end of every run
    fig = Figure(figsize=(11, 7))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.07, right=0.93, bottom=0.08, top=0.95, wspace=0.3, hspace=0.35)
    (loss, lr), (grad, speed) = fig.subplots(2, 2)
    loss.plot(*data["loss"]["train loss"], label="train loss")
    # evaluation points as markers: a line between two of them would claim values nobody measured
    loss.plot(*data["loss"]["eval loss"], "o", linestyle="none", label="eval loss")
    for i, step in enumerate(data["loss"]["skipped step"][0]):
        loss.axvline(step, color="tab:red", linestyle=":", linewidth=1,
                     label="skipped step (step guard)" if i == 0 else None)
    loss.set_title("loss")
    loss.legend()
    lr.plot(*data["learning_rate"]["learning rate"], color="tab:green")
    lr.set_title("learning rate")
    grad.plot(*data["grad_norm"]["gradient norm"], color="tab:red")
    grad.set_title("gradient norm (before clipping)")
    speed.plot(*data["throughput_memory"]["tokens/s"], color="tab:purple", label="tokens/s")
    speed.set_title("throughput and peak memory")
    speed.set_ylabel("tokens/s")
    memory = speed.twinx()
    kind = next((e["memory_kind"] for e in entries if "memory_kind" in e), "memory")
    memory.plot(*data["throughput_memory"]["peak memory (MiB)"], "--", color="tab:gray",
                label=f"{kind} (MiB, max rank)")
    memory.set_ylabel("MiB")
    lines = speed.get_lines() + memory.get_lines()  # one legend for both axes: tokens/s and memory
    memory.legend(lines, [line.get_label() for line in lines], loc="lower right")
    for ax in (loss, lr, grad, speed):
        ax.set_xlabel("step")
    return fig


def main(argv: list[str] | None = None) -> int:
    """`shardtrain report OUTPUT_DIR [--out PNG]`; 0 when drawn, 2 with an `error:` line otherwise."""
    import argparse

    parser = argparse.ArgumentParser(prog="shardtrain report", description="draw report.png from metrics.jsonl")
    parser.add_argument("output_dir")
    parser.add_argument("--out", help="PNG path (default: OUTPUT_DIR/report.png)")
    args = parser.parse_args(argv)
    metrics = Path(args.output_dir) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"error: {metrics} does not exist; pass the output_dir of a training run", file=sys.stderr)
        return 2
    try:
        out = draw_report(metrics, args.out or Path(args.output_dir) / "report.png")
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
