"""The seeded chaos run (`scripts/chaos_replicas.py`), as a user runs it: 3 groups, 60 steps, SIGKILLs in a step,
during a checkpoint save, during a recovery, of a launcher alone, of every group at once, and of a group started
after the job finished; then one process replays the record.

~3.5 min on 2 cores. Every wait in the script has a deadline that names what it waited for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launch import worker_env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos_replicas.py"


def test_a_seeded_chaos_run_loses_nothing_and_trains_nothing_twice(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--seed", "0", "--out", str(tmp_path / "chaos")],
                          capture_output=True, text=True, env=worker_env(), timeout=1200)
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(done.stdout)
    kills = result["kills"]
    assert result["kills_total"] >= 10 and all(kills[kind] >= 1 for kind in kills), kills
    assert result["unplanned_failures"] == []  # no group ended on its own
    assert result["every_step_once"] and result["committed_steps"] == 60
    assert result["every_share_once"] and result["refed_shares"] > 0  # every lost share re-fed exactly once
    assert result["steps_without_all_groups"] > 0 and result["recoveries"] >= 2  # groups left, healed, came back
    assert result["final_models"] >= 1 and result["final_weights_max_abs_diff"] <= 1e-5
    checkpoints = result["checkpoints"]
    assert len(checkpoints) >= 8 and all(c["step_ok"] and c["max_abs_diff"] <= 1e-5 for c in checkpoints.values())
    assert result["late_restart"] == {"exit_code": 0, "said_finished": True, "files_unchanged": True}
