"""`benchmarks/gpu.py --tiny` runs on CPU (so the GPU benchmark does not rot): all six modes train, report their
figures, compile does not change what eager computes, and shardtrain's Trainer computes transformers' Trainer's
losses (bf16 both, so within bf16 noise); the planner's prediction sits beside them."""

import json
import math
import subprocess
import sys

from launch import REPO, benchmark_module, worker_env

GPU_PY = REPO / "benchmarks" / "gpu.py"
MODES = benchmark_module("gpu").MODES  # the benchmark's own list (its imports at module level are the stdlib's)


def test_gpu_benchmark_tiny_runs_every_mode(tmp_path):
    out = tmp_path / "gpu.json"
    # transformers' compiled DDP model is not profiled here: on CPU (torch 2.13), stopping the profiler after its
    # step crashed rank 0 in about one run in ten (SIGSEGV, or std::bad_alloc raised by the profiler's stop), only
    # in that mode, the sixth profiler session of the process; every other mode, and that mode unprofiled, run
    profiled = [mode for mode in MODES if mode != "hf_compile"]
    proc = subprocess.run([sys.executable, str(GPU_PY), "--tiny", "--profile-steps", "1",
                           "--profile-modes", ",".join(profiled), "--out", str(out)],
                          env=worker_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["world_size"] == 2 and result["tiny"]
    kinds, hows = ("trainer", "raw", "hf"), ("eager", "compile")
    assert set(result["modes"]) == {f"{kind}_{how}" for kind in kinds for how in hows}
    for name, mode in result["modes"].items():
        assert len(mode["losses"]) == 5 and all(math.isfinite(x) for x in mode["losses"])  # 1 + 3 timed + 1 more
        if name in profiled:
            assert mode["profile"]["steps"] == 1 and mode["profile"]["busy_ms_per_step"] > 0
            assert "aten::mm" in mode["profile"]["top_ops"]
        else:
            assert "profile" not in mode
        assert mode["tokens_per_s_per_gpu"] > 0 and mode["step_s_median"] > 0
        assert mode["mfu"] is None and mode["peak_memory_gib"] is None  # no CUDA, no peak FLOP/s

    def gap(a: str, b: str) -> float:
        return max(abs(x - y) for x, y in zip(result["modes"][a]["losses"], result["modes"][b]["losses"], strict=True))

    for kind in ("trainer", "raw", "hf"):
        assert gap(f"{kind}_eager", f"{kind}_compile") < 0.05
    assert gap("trainer_eager", "hf_eager") < 0.01  # both log the global batch's mean loss
    planned = result["planned"]
    assert planned["peak_memory_gib"] > 0 and planned["compute_s"] > 0 and "bf16" in planned["flops_rate_source"]
