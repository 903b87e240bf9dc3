"""`benchmarks/gpu.py --tiny` runs on CPU (so the GPU benchmark does not rot): all six modes train, report their
figures, compile does not change what eager computes, and shardtrain's Trainer computes transformers' Trainer's
losses (bf16 both, so within bf16 noise); the planner's prediction sits beside them."""

import json
import math
import subprocess
import sys

from launch import REPO, worker_env


def test_gpu_benchmark_tiny_runs_every_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--tiny", "--profile-steps", "1",
                           "--out", str(out)],
                          env=worker_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["world_size"] == 2 and result["tiny"]
    kinds, hows = ("trainer", "raw", "hf"), ("eager", "compile")
    assert set(result["modes"]) == {f"{kind}_{how}" for kind in kinds for how in hows}
    for mode in result["modes"].values():
        assert len(mode["losses"]) == 5 and all(math.isfinite(x) for x in mode["losses"])  # 1 + 3 timed + 1 profiled
        assert mode["profile"]["steps"] == 1 and mode["profile"]["busy_ms_per_step"] > 0
        assert "aten::mm" in mode["profile"]["top_ops"]
        assert mode["tokens_per_s_per_gpu"] > 0 and mode["step_s_median"] > 0
        assert mode["mfu"] is None and mode["peak_memory_gib"] is None  # no CUDA, no peak FLOP/s

    def gap(a: str, b: str) -> float:
        return max(abs(x - y) for x, y in zip(result["modes"][a]["losses"], result["modes"][b]["losses"], strict=True))

    for kind in ("trainer", "raw", "hf"):
        assert gap(f"{kind}_eager", f"{kind}_compile") < 0.05
    assert gap("trainer_eager", "hf_eager") < 0.01  # both log the global batch's mean loss
    planned = result["planned"]
    assert planned["peak_memory_gib"] > 0 and planned["compute_s"] > 0 and "bf16" in planned["flops_rate_source"]
