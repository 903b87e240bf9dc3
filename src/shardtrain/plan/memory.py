"""The per-rank memory plan: rows of the report from a traced step, whether it fits, and what would make it fit.

    from shardtrain.plan.memory import memory_rows, fit_advice
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.config.values import as_bytes
from shardtrain.errors import PlanError
from shardtrain.plan.trace import ACTIVATION, GATHERED, GRAD_BUFFERS, STATE_GRAD, STATE_OPT, STATE_PARAM, StepTrace


def parse_bytes(text: str | int | float, name: str = "--device-memory") -> int:
    """'80GiB', '80 GB', '81920MiB' or a number of bytes -> bytes.

    Raises:
        PlanError: text that is not a positive size.
    """
    return as_bytes(name, text, PlanError)


def human(n: float) -> str:
    """Bytes in binary units, 3 significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B" or abs(n) >= 100:
                return f"{n:.0f} {unit}"
            return f"{n:.1f} {unit}" if abs(n) >= 10 else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


@dataclass(frozen=True)
class MemoryRow:
    """One line of the memory table: a name, bytes on one rank, and what the number is."""

    name: str
    bytes: int
    note: str = ""


def _sum(snap: dict[str, int], keys: tuple[str, ...]) -> int:
    return sum(snap.get(k, 0) for k in keys)


def device_peak(trace: StepTrace, cpu_offload: bool, target: str) -> int:
    """The peak on the training device: under CPU offload on an accelerator, without what stays on the host."""
    if cpu_offload and target != "cpu":
        return trace.peak_offloaded_device
    return trace.peak


# row labels of the activation-checkpointing modes ("with AC" is full checkpointing, as before selective existed;
# "sel. AC" keeps the name within the table's 32-character column)
_AC_LABELS = {"none": "no AC", "selective": "sel. AC", "full": "with AC"}
# what to suggest when the peak does not fit: the modes that keep less than the current one, in that order
_STRONGER = {"none": ("selective", "full"), "selective": ("full",), "full": ()}
_AC_CHANGES = {"selective": 'activation_checkpointing: "selective"', "full": "activation_checkpointing: true"}


def memory_rows(trace: StepTrace, ac_traces: dict[str, StepTrace]) -> list[MemoryRow]:
    """Rows of the table: training state, the largest gathered units, activations, logits and loss, the peak.

    Args:
        trace: the planned step.
        ac_traces: the step traced per activation-checkpointing mode ("none", "selective", "full"); one
            "activations per layer" row for each.
    """
    snap = trace.peak_breakdown
    units = sorted(trace.units, key=lambda u: -u[1])
    two = sum(size for _, size in units[:2])
    rows = [
        MemoryRow("parameters (sharded)", trace.state["parameters"], "this rank's shards + buffers"),
        MemoryRow("gradients (sharded)", trace.state["gradients"], "after reduce-scatter"),
        MemoryRow("optimizer state", trace.state["optimizer_state"], "AdamW exp_avg + exp_avg_sq + step"),
        MemoryRow("largest unit, all-gathered", units[0][1] if units else 0, units[0][0] if units else ""),
        MemoryRow("2 units in flight (prefetch)", two, "+".join(name for name, _ in units[:2])),
    ]
    for mode, label in _AC_LABELS.items():
        layer_trace = ac_traces.get(mode)
        if layer_trace is not None and layer_trace.layer_activations:
            sizes = [size for _, size in layer_trace.layer_activations]
            typical = max(set(sizes), key=lambda s: (sizes.count(s), s))  # the repeated (decoder) layers
            rows.append(MemoryRow(f"activations per layer ({label})", typical,
                                  f"kept for backward by each of {sizes.count(typical)} layers"))
    chunk = trace.loss_chunk_size
    rows += [
        MemoryRow("logits", trace.logits, "model output, until the loss" if not chunk else
                  f"none for the whole micro-batch (loss_chunk_size {chunk})"),
        MemoryRow("loss buffers", trace.loss_buffers, "kept by the loss for backward (fp32 log-probs)"),
        MemoryRow("loss part (head + loss)", trace.loss_peak,
                  "most bytes above the head's input, forward to its gradient" +
                  (f"; {chunk} tokens per chunk" if chunk else "; unchunked")),
        MemoryRow("at the peak: sharded state", _sum(snap, STATE_PARAM + STATE_GRAD + STATE_OPT),
                  "parameters + gradients + optimizer state"),
        MemoryRow("at the peak: gathered params", _sum(snap, GATHERED), "unsharded parameters + all-gather buffers"),
        MemoryRow("at the peak: grad buffers", _sum(snap, GRAD_BUFFERS), "unsharded gradients + reduce-scatter input"),
        MemoryRow("at the peak: activations", _sum(snap, ACTIVATION), "saved activations, temporaries, inputs"),
        MemoryRow("predicted peak", trace.peak, "rank 0 (the largest shard)"),
    ]
    return rows


def fit_advice(trace: StepTrace, ac_traces: dict[str, StepTrace], device_memory: int, *, cpu_offload: bool,
               ac_mode: str, target: str, world_size: int, fixed: int) -> dict:
    """Whether the peak fits `device_memory`, the smallest world size that fits (the sharded state scales with
    1 / dp_shard; the rest does not), and single changes of settings that fit at this world size.

    Args:
        ac_traces: the step per activation-checkpointing mode; each mode that keeps less than `ac_mode`
            (none < selective < full) and was traced becomes an option.
        ac_mode: the planned mode ("none", "selective" or "full").
        fixed: product of the sizes that stay (dp_replicate x cp x tp); the world size grows with dp_shard.
    """
    if device_memory <= 0:
        raise PlanError(f"device memory = {device_memory} must be > 0")
    peak = device_peak(trace, cpu_offload, target)
    snap = trace.peak_breakdown
    sharded = 0 if (cpu_offload and target != "cpu") else _sum(snap, STATE_PARAM + STATE_GRAD + STATE_OPT)
    rest = peak - sharded
    shard = max(world_size // fixed, 1)
    smallest = None
    for dp_shard in (2**i for i in range(0, 15)):
        if sharded * shard / dp_shard + rest <= device_memory:
            smallest = dp_shard * fixed
            break
    options = []
    for mode in _STRONGER[ac_mode]:
        if mode in ac_traces:
            ac_peak = device_peak(ac_traces[mode], cpu_offload, target)
            options.append({"change": _AC_CHANGES[mode], "peak": ac_peak, "fits": ac_peak <= device_memory})
    if not cpu_offload and target != "cpu":
        off = trace.peak_offloaded_device
        options.append({"change": "cpu_offload: true", "peak": off, "fits": off <= device_memory})
    act = _sum(snap, ACTIVATION)
    for divisor in (2, 4):
        est = peak - act + act // divisor
        options.append({"change": f"tokens per device / {divisor} (batch, sequence or cp x {divisor}; estimate: "
                                  "activations scale with tokens)",
                        "peak": est, "fits": est <= device_memory})
    return {"device_memory": device_memory, "peak": peak, "fits": peak <= device_memory,
            "headroom": device_memory - peak, "smallest_world_size": smallest,
            "smallest_world_size_note": "sharded state x dp_shard / new dp_shard + the rest (unchanged)",
            "options": options}
