"""The same shardtrain step at two commits, in one run: did a change make the step slower, or was it the machine?

    python benchmarks/compare_commits.py --base 2a74b9a --size 50m --out benchmarks/results/commits_50m.json

The base commit is checked out in a temporary `git worktree`; each launch runs this tree's `benchmarks/worker.py`
(`--mode shardtrain`, 2 ranks, gloo, 1 thread each) with `PYTHONPATH` pointing at one tree's `src`, so only the
package differs. The commits are interleaved `--repeats` times, with transformers' Trainer (`--mode hf`) launched
in each round as the machine's yardstick. Reports each commit's median step (pooled timed steps), CPU time per
step, and main / base. Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402

REPO = HERE.parent


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "timing" in r]
    if not ok:
        return {"error": runs[-1].get("error"), "stderr_tail": runs[-1].get("stderr_tail")}
    steps = [s for r in ok for s in r["timing"]["step_times_s"]]
    cpu = [r["timing"].get("cpu_time_per_step_s_median") for r in ok]
    return {"step_s_median": statistics.median(steps), "per_repeat": [r["timing"]["step_time_s_median"] for r in ok],
            "cpu_s_per_step_rank0_per_repeat": cpu, "package": ok[0].get("shardtrain_package"),
            "mean_loss": ok[0].get("mean_loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the older commit (any git revision)")
    parser.add_argument("--size", default="50m", choices=["tiny", "50m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("commits.json"))
    cli = parser.parse_args()
    timed, warmup = compare.FULL_STEPS[cli.size]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    base = subprocess.run(["git", "rev-parse", cli.base], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"main": [], "base": [], "hf": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tree = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), base], cwd=REPO, check=True,
                       capture_output=True)
        try:
            sources = {"main": REPO / "src", "base": tree / "src", "hf": REPO / "src"}
            for repeat in range(cli.repeats):
                for label, src in sources.items():
                    compare.EXTRA_ENV["PYTHONPATH"] = str(src)
                    compare.log(f"{cli.size} {label} repeat {repeat + 1}/{cli.repeats}")
                    mode = "hf" if label == "hf" else "shardtrain"
                    runs[label].append(compare.launch(["--mode", mode, "--size", cli.size, "--steps", str(timed),
                                                       "--warmup", str(warmup)], 2,
                                                      tmp / f"{label}_{repeat}.json", 900))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    result = {"machine": compare.machine_info(), "size": cli.size, "repeats": cli.repeats,
              "steps": {"timed": timed, "warmup": warmup}, "commits": {"main": head, "base": base},
              "runs": {label: _summary(r) for label, r in runs.items()}, "wall_s": round(time.perf_counter() - started)}
    main_s, base_s = (result["runs"][k].get("step_s_median") for k in ("main", "base"))
    hf_s = result["runs"]["hf"].get("step_s_median")
    if main_s and base_s:
        result["main_over_base"] = round(main_s / base_s, 3)
    if hf_s:
        result["over_hf"] = {k: round(result["runs"][k]["step_s_median"] / hf_s, 3)
                             for k in ("main", "base") if result["runs"][k].get("step_s_median")}
    text = json.dumps(result, indent=1)
    cli.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
