"""Stress the end of multi-rank runs: many finished torchrun launches, count aborts at interpreter exit.

Usage (from the repository root):

    OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1 .venv/bin/python scripts/stress_teardown.py \
        [--launches 50] [--busy 2] [--jobs-per-process 3] [--nprocs 2,4] [--teardowns none,destroy,torch]
        [--timeout 300] [--keep-logs DIR]

Each launch is `python -m torch.distributed.run --nproc_per_node N --master_addr 127.0.0.1 --master_port P
scripts/stress_teardown_worker.py ...` on a fresh free port; N cycles through --nprocs, and the worker's
end cycles through --teardowns: no teardown at all (none), `shardtrain.destroy_distributed()` (destroy),
`torch.distributed.destroy_process_group()` (torch). Each worker process runs
--jobs-per-process Trainer jobs (tiny Llama, a few steps with a SHARDED_STATE_DICT checkpoint, evaluate,
save_model). --busy N keeps N extra CPU-burning processes running during the launches (a loaded machine
makes thread-timing races at exit likelier).

Prints one JSON object: launches, aborts (return code -6 / 134, or "terminate called" in stderr), other
failures (any other non-zero code, or a timeout), counts per nproc and per teardown variant, seconds, and
the tail of stderr of the first few bad launches. Exit code 1 when any launch was bad.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from shardtrain.parallel.distributed import find_free_port  # noqa: E402

WORKER = Path(__file__).resolve().parent / "stress_teardown_worker.py"


def _burn() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def _is_abort(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode in (-6, 134) or "terminate called" in proc.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--busy", type=int, default=0, help="extra CPU-burning processes during the launches")
    parser.add_argument("--jobs-per-process", type=int, default=3)
    parser.add_argument("--nprocs", default="2,4", help="comma-separated ranks per launch, cycled")
    parser.add_argument("--teardowns", default="none,destroy,torch", help="worker endings, cycled")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--keep-logs", default=None, help="write each bad launch's stdout/stderr here")
    cli = parser.parse_args()
    nprocs = [int(n) for n in cli.nprocs.split(",")]
    teardowns = cli.teardowns.split(",")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SHARDTRAIN_CPU="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")

    burners = [mp.Process(target=_burn, daemon=True) for _ in range(cli.busy)]
    for proc in burners:
        proc.start()
    counts: dict[str, dict[str, int]] = {}
    bad_tails: list[dict] = []
    aborts = failures = 0
    start = time.monotonic()
    try:
        for i in range(cli.launches):
            nproc = nprocs[i % len(nprocs)]
            teardown = teardowns[(i // len(nprocs)) % len(teardowns)]
            with tempfile.TemporaryDirectory(prefix="stress_teardown_") as out:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                       "--master_addr", "127.0.0.1", "--master_port", str(find_free_port()), str(WORKER), out,
                       "--jobs", str(cli.jobs_per_process), "--teardown", teardown]
                t0 = time.monotonic()
                try:
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cli.timeout)
                except subprocess.TimeoutExpired as exc:
                    proc = subprocess.CompletedProcess(cmd, "timeout", _text(exc.stdout), _text(exc.stderr))
            key = f"nproc{nproc}/{teardown}"
            entry = counts.setdefault(key, {"launches": 0, "aborts": 0, "other_failures": 0})
            entry["launches"] += 1
            status = "ok"
            if proc.returncode == 0 and not _is_abort(proc):
                pass
            elif proc.returncode != "timeout" and _is_abort(proc):
                aborts += 1
                entry["aborts"] += 1
                status = "ABORT"
            else:
                failures += 1
                entry["other_failures"] += 1
                status = "FAIL"
            print(f"[{i + 1}/{cli.launches}] {key} rc={proc.returncode} {status} {time.monotonic() - t0:.1f}s",
                  file=sys.stderr, flush=True)
            if status != "ok":
                if len(bad_tails) < 5:
                    bad_tails.append({"launch": i, "key": key, "returncode": proc.returncode,
                                      "stderr_tail": proc.stderr[-1500:]})
                if cli.keep_logs:
                    logs = Path(cli.keep_logs)
                    logs.mkdir(parents=True, exist_ok=True)
                    (logs / f"launch{i}.stdout").write_text(proc.stdout)
                    (logs / f"launch{i}.stderr").write_text(proc.stderr)
    finally:
        for proc in burners:
            proc.terminate()
    result = {"launches": cli.launches, "aborts": aborts, "other_failures": failures, "busy": cli.busy,
              "jobs_per_process": cli.jobs_per_process, "per_variant": counts,
              "per_nproc": {str(n): {k: sum(v[k] for key, v in counts.items() if key.startswith(f"nproc{n}/"))
                                     for k in ("launches", "aborts", "other_failures")} for n in nprocs},
              "seconds": round(time.monotonic() - start, 1), "bad": bad_tails}
    print(json.dumps(result, indent=2))
    return 1 if aborts or failures else 0


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


if __name__ == "__main__":
    sys.exit(main())
