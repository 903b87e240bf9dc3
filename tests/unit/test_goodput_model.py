"""`benchmarks/goodput.py`: the table users read (the same as the docs'), from flags, against the model by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "goodput.py"


def run(*flags: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def by_hand(machines: int, restart: float = 300, detection: float = 5, recovery: float = 30, step: float = 5,
            quorum: float = 0.01) -> tuple[float, float]:
    rate = machines / (5000 * 3600)
    useful = 1800 / 1830
    whole = useful * (1 - rate * (detection + restart + 900) / useful)
    groups = machines // 8
    replicas = useful * (1 - rate * (restart + recovery) / groups) * (1 - rate * (detection + step + recovery)) \
        * step / (step + quorum)
    return whole, replicas


def test_the_default_table_is_the_model_with_the_documented_cluster_costs():
    text = run()
    rows = [line for line in text.splitlines() if line.startswith("| 4,096 ")]
    whole, replicas = by_hand(4096)
    assert rows == [f"| 4,096 | 19.66 | {whole:.3f} | {replicas:.3f} |"], text
    assert "restart 300 s, detection 5 s, recovery 30 s" in text
    docs = (SCRIPT.parents[1] / "docs" / "benchmarks.md").read_text()
    assert rows[0] in docs  # the docs show what the script prints


def test_every_cost_is_a_flag_and_the_detection_stall_costs_the_replica_groups():
    base = json.loads(run("--json"))["rows"][-1]
    slower = json.loads(run("--json", "--detection-s", "60", "--restart-s", "900"))
    assert slower["assumptions"]["detection_s"] == 60 and slower["assumptions"]["restart_s"] == 900
    whole, replicas = by_hand(4096, restart=900, detection=60)
    assert slower["rows"][-1]["restart_from_checkpoint"] == round(whole, 4)
    assert slower["rows"][-1]["replica_groups"] == round(replicas, 4) < base["replica_groups"]
