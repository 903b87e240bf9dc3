"""`benchmarks/gpu.py --tiny` runs on CPU (so the GPU benchmark does not rot): all four modes train, report their
figures, and compile does not change what eager computes (bf16, so within bf16 noise)."""

import json
import math
import subprocess
import sys

from launch import REPO, worker_env


def test_gpu_benchmark_tiny_runs_every_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--tiny", "--out", str(out)],
                          env=worker_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["world_size"] == 2 and result["tiny"]
    assert set(result["modes"]) == {"trainer_eager", "trainer_compile", "raw_eager", "raw_compile"}
    for mode in result["modes"].values():
        assert len(mode["losses"]) == 4 and all(math.isfinite(x) for x in mode["losses"])
        assert mode["tokens_per_s_per_gpu"] > 0 and mode["step_s_median"] > 0
        assert mode["mfu"] is None and mode["peak_memory_gib"] is None  # no CUDA, no peak FLOP/s
    for kind in ("trainer", "raw"):
        eager, compiled = result["modes"][f"{kind}_eager"]["losses"], result["modes"][f"{kind}_compile"]["losses"]
        assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 0.05
