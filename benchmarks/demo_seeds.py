"""The demo's result over several seeds: does `bash scripts/demo.sh` learn the sum on every one of them?

    .venv/bin/python benchmarks/demo_seeds.py                                  # seeds 0-4, bar 0.9: ~5 min
    .venv/bin/python benchmarks/demo_seeds.py --seeds 0,1,2,3,4 --bar 0.9 --out demo_seeds.json
    .venv/bin/python benchmarks/demo_seeds.py -- --learning_rate 3e-3 --adam_beta2 0.999 --warmup_steps 20 \
        --init_std 0.02                                                        # the old defaults: exits 1

Each seed is one run of `examples/train_demo.py --seed S` exactly as the demo starts it: `shardtrain launch --cpu
--num_processes 2` (FSDP2, gloo, `OMP_NUM_THREADS=1` per rank), one launch after the other, each on a free port.
`--seed` seeds the model's initial weights, the generated training and evaluation sets and the Trainer (data
order). Arguments after `--` go to every run (the demo's defaults otherwise).

Prints one JSON object (and writes it to `--out`): per seed the exact match of the answers the model generates
under FSDP2 (`generated_exact_match`, the demo's headline), the teacher-forced exact match and token accuracy,
the first and final train loss, the training seconds (`trainer.train()` alone) and the launch's wall seconds; then
the minimum and maximum over the seeds and `passed`. Exits 1 when a seed's generated exact match is below `--bar`
(or a run fails), 0 otherwise. The machine's 1-minute load average before each launch is recorded: the runs use
both cores of a 2-core machine, so other work slows them (the accuracies do not depend on it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "train_demo.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shardtrain_cmd() -> list[str]:
    """`shardtrain` next to this Python (the venv's), else the module."""
    script = Path(sys.executable).with_name("shardtrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardtrain.cli.main"]


def run_seed(seed: int, out_dir: Path, extra: list[str]) -> dict:
    """One 2-rank demo run; the fields of its summary that this benchmark reports."""
    cmd = [*shardtrain_cmd(), "launch", "--cpu", "--num_processes", "2", "--main_process_port", str(free_port()),
           str(DEMO), "--output_dir", str(out_dir), "--seed", str(seed), *extra]
    load = os.getloadavg()[0]
    print(f"seed {seed}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not (out_dir / "summary.json").is_file():
        print(proc.stderr[-4000:], file=sys.stderr)
        return {"seed": seed, "returncode": proc.returncode, "wall_s": round(wall, 1), "load_avg_1m_before": load}
    summary = json.loads((out_dir / "summary.json").read_text())
    row = {
        "seed": seed, "returncode": 0, "generated_exact_match": summary["generated_exact_match"],
        "eval_exact_match": summary["eval_exact_match_after"],
        "eval_token_accuracy": summary["eval_token_accuracy_after"],
        "first_train_loss": summary["first_train_loss"], "final_train_loss": summary["final_train_loss"],
        "eval_loss": summary["eval_loss_after"], "steps": summary["steps"], "train_seconds": summary["seconds"],
        "wall_s": round(wall, 1), "load_avg_1m_before": round(load, 2),
    }
    print(f"seed {seed}: " + json.dumps(row), file=sys.stderr, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (default 0,1,2,3,4)")
    parser.add_argument("--bar", type=float, default=0.9, help="lowest generated exact match allowed (default 0.9)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--keep", help="keep the runs' output directories under this folder (default: a temp dir)")
    parser.add_argument("demo_args", nargs=argparse.REMAINDER, help="after --: arguments for train_demo.py")
    cli = parser.parse_args()
    extra = cli.demo_args[1:] if cli.demo_args[:1] == ["--"] else cli.demo_args
    seeds = [int(s) for s in cli.seeds.split(",") if s.strip()]

    with tempfile.TemporaryDirectory(prefix="demo_seeds_") as tmp:
        root = Path(cli.keep) if cli.keep else Path(tmp)
        rows = [run_seed(seed, root / f"seed{seed}", extra) for seed in seeds]

    done = [r for r in rows if r["returncode"] == 0]
    generated = [r["generated_exact_match"] for r in done]
    failed = len(done) < len(rows) or any(g < cli.bar for g in generated)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "demo_args": extra, "bar": cli.bar,
        "seeds": rows,
        "min_generated_exact_match": min(generated, default=None),
        "max_generated_exact_match": max(generated, default=None),
        "min_eval_exact_match": min((r["eval_exact_match"] for r in done), default=None),
        "max_final_train_loss": max((r["final_train_loss"] for r in done), default=None),
        "max_train_seconds": max((r["train_seconds"] for r in done), default=None),
        "passed": not failed,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if cli.out:
        Path(cli.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
