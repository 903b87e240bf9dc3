"""Shared pieces of the benchmarks: model sizes, data, memory and tensor-byte accounting, step timing.

Not run directly; imported by `worker.py` (which `compare.py` launches):

    python benchmarks/compare.py --out results.json
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class SizeSpec:
    """One benchmarked model: Llama shape, sequence length and per-rank batch."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    seq_len: int
    per_device_batch: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SIZES: dict[str, SizeSpec] = {
    # The README / examples/train_demo.py model (~0.8M parameters).
    "tiny": SizeSpec("tiny", vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, seq_len=32, per_device_batch=8),
    # ~50.2M parameters (untied 32000 x 512 embedding and lm_head are 32.8M of them).
    "50m": SizeSpec("50m", vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4, seq_len=32, per_device_batch=4),
}

LAYER_CLASS = "LlamaDecoderLayer"
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
# AdamW's fused kernel in every mode: the default of shardtrain and of Hugging Face (optim="adamw_torch_fused")
FUSED_ADAMW = True
SEED = 42
MODEL_SEED = 0
DATA_SEED = 1234


def llama_config(spec: SizeSpec) -> Any:
    """The Llama config of `spec` (untied embeddings, no cache)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                       intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                       num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                       max_position_embeddings=max(64, spec.seq_len), tie_word_embeddings=False, use_cache=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model(spec: SizeSpec) -> nn.Module:
    """The same fp32 Llama (same initial weights) for every mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(MODEL_SEED)
    return LlamaForCausalLM(llama_config(spec))


def make_samples(spec: SizeSpec, n: int) -> list[dict[str, torch.Tensor]]:
    """`n` fixed-length samples of random token ids (no padding; labels = input_ids, all 1s mask)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(3, spec.vocab_size, (n, spec.seq_len), generator=gen)
    ones = torch.ones(spec.seq_len, dtype=torch.long)
    return [{"input_ids": row.clone(), "attention_mask": ones.clone(), "labels": row.clone()} for row in ids]


def stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


# -- memory -------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    """Current resident set size of this process."""
    return psutil.Process(os.getpid()).memory_info().rss


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryBaseline:
    """RSS at a point after imports and process-group set-up, before the model is built.

    The model code (transformers' Llama, FSDP) is imported first so that the delta is training state,
    activations, communication buffers and allocator caches, not code.
    """

    def __init__(self) -> None:
        import transformers.models.llama.modeling_llama  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401

        self.rss = rss_bytes()
        self.peak_before = peak_rss_bytes()

    def report(self) -> dict[str, int]:
        peak = peak_rss_bytes()
        return {"baseline_rss_bytes": self.rss, "peak_rss_bytes": peak,
                "peak_rss_delta_bytes": peak - self.rss, "end_rss_delta_bytes": rss_bytes() - self.rss,
                "peak_before_baseline_bytes": self.peak_before}


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def param_bytes(model: nn.Module) -> int:
    return tensors_bytes(model.parameters())


def grad_bytes(model: nn.Module) -> int:
    return tensors_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's optimizer state by kind (AdamW: exp_avg, exp_avg_sq, step)."""
    out: dict[str, int] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[key] = out.get(key, 0) + tensors_bytes([value])
    return out


def sharding_facts(model: nn.Module) -> dict[str, Any]:
    """Whether parameters are really sharded: DTensor params, FSDP units, local vs full element counts."""
    from torch.distributed.fsdp import FSDPModule

    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    local_numel = sum(local(p).numel() for p in params)
    full_numel = sum(p.numel() for p in params)
    return {"num_params": len(params), "num_dtensor_params": len(dtensors),
            "num_fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "local_numel": local_numel, "full_numel": full_numel,
            "local_fraction": round(local_numel / max(full_numel, 1), 4),
            "sharded": bool(dtensors) and local_numel < full_numel}


# -- timing -------------------------------------------------------------------------------------------
class StepTimer:
    """Timestamps the end of each step after a barrier (so a step is over on every rank), plus CPU time."""

    def __init__(self, use_barrier: bool = True) -> None:
        self.use_barrier = use_barrier and dist.is_available() and dist.is_initialized()
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []
        self.usage: list[resource.struct_rusage] = []

    def mark(self) -> None:
        if self.use_barrier:
            dist.barrier()
        self.marks.append(time.perf_counter())
        self.cpu_marks.append(time.process_time())
        self.usage.append(resource.getrusage(resource.RUSAGE_SELF))

    def usage_per_step(self, warmup: int) -> dict[str, float]:
        """Median user / system CPU seconds and minor page faults per timed step (this process, all threads)."""
        pairs = list(zip(self.usage, self.usage[1:], strict=False))[warmup:]
        if not pairs:
            return {}
        return {"user_s_median": statistics.median(b.ru_utime - a.ru_utime for a, b in pairs),
                "sys_s_median": statistics.median(b.ru_stime - a.ru_stime for a, b in pairs),
                "minor_page_faults_median": statistics.median(b.ru_minflt - a.ru_minflt for a, b in pairs),
                "voluntary_ctx_switches_median": statistics.median(b.ru_nvcsw - a.ru_nvcsw for a, b in pairs),
                "involuntary_ctx_switches_median": statistics.median(b.ru_nivcsw - a.ru_nivcsw for a, b in pairs)}

    def durations(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def cpu_durations(self) -> list[float]:
        return [b - a for a, b in zip(self.cpu_marks, self.cpu_marks[1:], strict=False)]


def summarize_steps(durations: list[float], cpu_durations: list[float], warmup: int,
                    tokens_per_step: int) -> dict[str, Any]:
    """Median step time over the steps after `warmup`; steps/s and tokens/s from that median."""
    timed = durations[warmup:]
    cpu = cpu_durations[warmup:]
    if not timed:
        raise ValueError(f"no timed steps: {len(durations)} steps recorded, warmup {warmup}")
    median = statistics.median(timed)
    return {"timed_steps": len(timed), "warmup_steps": warmup,
            "step_time_s_median": median, "step_time_s_mean": statistics.fmean(timed),
            "step_time_s_min": min(timed), "step_time_s_max": max(timed),
            "step_time_s_stdev": statistics.stdev(timed) if len(timed) > 1 else 0.0,
            "cpu_time_per_step_s_median": statistics.median(cpu) if cpu else None,
            "steps_per_s": 1.0 / median, "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_step / median,
            "step_times_s": [round(t, 6) for t in timed]}


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    items: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(items, obj)
    return items if dist.get_rank() == 0 else None


def run_worker(cmd: list[str], env: dict[str, str], what: str, cwd: str | os.PathLike | None = None) -> None:
    """Run a benchmark's worker launch; exit with its stderr's end when it fails (a benchmark prints no partial
    result)."""
    import subprocess
    import sys

    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        sys.exit(f"{what} failed:\n{proc.stderr[-4000:]}")


def launch_self(script: str | os.PathLike, nproc: int, args: list[str], what: str, cpu: bool = True) -> Any:
    """Run `script --worker --out-file F ARGS` on `nproc` ranks (torch.distributed.run, 1 thread per rank, this
    folder on PYTHONPATH) and return the JSON its rank 0 wrote to F; exit with stderr's end when it fails."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    if cpu:
        env["SHARDTRAIN_CPU"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), str(script),
               "--worker", "--out-file", str(out_file), *args]
        run_worker(cmd, env, what, cwd=here.parent)
        return json.loads(out_file.read_text())


def emit(result: dict[str, Any], out: str | os.PathLike | None) -> None:
    """Print the benchmark's JSON and write it to `out` when given."""
    import json
    from pathlib import Path

    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
