"""What `shardtrain.plan(...)` returns (`Plan`), and how it is shown: a human table (the default of `shardtrain
plan`) or plain JSON types (`--json`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardtrain.plan.lifecycle import PhaseMemory
from shardtrain.plan.memory import MemoryRow, human
from shardtrain.plan.trace import StepTrace


@dataclass
class Plan:
    """The result of `plan`: the inputs as resolved, the traced steps, the memory rows, fit and step time.

    `lifecycle` holds the load / step / save rows (per-rank host and device bytes, `plan/lifecycle.py`).
    `what_if_ac` is the step traced with activation checkpointing flipped (none <-> full; selective -> full),
    `ac_traces` every traced activation-checkpointing mode ("none", "selective", "full"), the planned one included.
    """

    model: str
    settings: dict[str, Any]
    trace: StepTrace
    rows: list[MemoryRow]
    peak: int
    fit: dict | None = None
    step: dict | None = None
    what_if_ac: StepTrace | None = field(default=None, repr=False)
    ac_traces: dict[str, StepTrace] = field(default_factory=dict, repr=False)
    lifecycle: list[PhaseMemory] = field(default_factory=list)
    host: dict | None = None  # host memory per machine (`lifecycle.host_per_machine`)

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON types (bytes as ints)."""
        return plan_dict(self)

    def table(self) -> str:
        """The human-readable report."""
        return plan_table(self)




def plan_dict(result: Plan) -> dict[str, Any]:
    """The plan as JSON types: bytes as ints, seconds as floats."""
    trace = result.trace
    out: dict[str, Any] = {
        "model": result.model, "settings": result.settings, "rank": 0,
        "memory": [{"name": r.name, "bytes": r.bytes, "note": r.note} for r in result.rows],
        "predicted_peak_bytes": result.peak,
        "loss_part_bytes": trace.loss_peak,
        "peak_breakdown_bytes": {k: v for k, v in trace.peak_breakdown.items() if k != "Total"},
        "units": [{"name": n, "gathered_bytes": b} for n, b in trace.units],
        "layer_activations_bytes": [{"name": n, "bytes": b} for n, b in trace.layer_activations],
    }
    if result.what_if_ac is not None:
        out["what_if_activation_checkpointing_flipped_peak_bytes"] = result.what_if_ac.peak
        out["layer_activations_flipped_bytes"] = [{"name": n, "bytes": b}
                                                  for n, b in result.what_if_ac.layer_activations]
    if len(result.ac_traces) > 1:
        out["what_if_activation_checkpointing_peak_bytes"] = {mode: t.peak for mode, t in result.ac_traces.items()}
    if result.lifecycle:
        out["load_step_save"] = [{"phase": r.name, "selected": r.selected, "note": r.note, "parts_bytes": r.parts,
                                  "rank0": {"host_bytes": r.rank0_host, "device_bytes": r.rank0_device},
                                  "other_ranks": {"host_bytes": r.other_host, "device_bytes": r.other_device}}
                                 for r in result.lifecycle]
    if result.fit is not None:
        out["fit"] = result.fit
    if result.step is not None:
        out["step_time"] = result.step
    if result.host is not None:
        out["host_memory_per_machine"] = result.host
    return out


def _lifecycle_lines(result: Plan) -> list[str]:
    """The load / step / save rows: peak bytes per rank; `*` marks the path the fsdp_config takes."""
    cpu = result.settings["target"] == "cpu"
    head = (f"{'load / step / save, per rank':<32} {'rank 0':>11} {'':>11} {'other ranks':>11} {'':>11}",
            f"{'(* = this fsdp_config)':<32} {'host':>11} {'device':>11} {'host':>11} {'device':>11}  note")
    lines = list(head)
    for r in result.lifecycle:
        cells = [human(r.rank0_host), "-" if cpu else human(r.rank0_device)]
        cells += ["-", "-"] if result.settings["world_size"] == 1 else \
            [human(r.other_host), "-" if cpu else human(r.other_device)]
        mark = "*" if r.selected else " "
        lines.append(f"{mark}{r.name:<31} " + " ".join(f"{c:>11}" for c in cells) + f"  {r.note}")
    return lines


def _fit_lines(fit: dict) -> list[str]:
    verdict = "fits" if fit["fits"] else "does NOT fit"
    lines = [f"Device memory {human(fit['device_memory'])}: {verdict} (peak {human(fit['peak'])}, headroom "
             f"{human(fit['headroom'])})"]
    if fit["smallest_world_size"] is not None:
        lines.append(f"  smallest world size that fits (same other sizes): {fit['smallest_world_size']} "
                     f"({fit['smallest_world_size_note']})")
    else:
        lines.append("  no world size up to 16384 x the fixed sizes fits: the unsharded part alone is too big")
    for option in fit["options"]:
        lines.append(f"  {option['change']}: peak {human(option['peak'])} -> "
                     f"{'fits' if option['fits'] else 'does not fit'}")
    return lines


def _step_lines(step: dict) -> list[str]:
    mfu = step.get("mfu", 1.0)
    lines = [
        f"Step time per rank: compute {step['compute_s'] * 1e3:.1f} ms ({step['flops'] / 1e12:.3g} TFLOP at "
        f"{step['flops_rate'] / 1e12:.3g} TFLOP/s, {step['flops_rate_source']})",
        f"  communication {step['comm_s'] * 1e3:.1f} ms ({human(step['wire_bytes'])} sent at "
        f"{step['link_rate'] / 1e9:.3g} GB/s, {step['link_rate_source']})",
        f"  step {step['step_s_full_overlap'] * 1e3:.1f} ms (full overlap) .. {step['step_s_no_overlap'] * 1e3:.1f} "
        f"ms (no overlap) at {'the full rate: a floor' if mfu < 1 else 'the full rate'}",
    ]
    if mfu < 1:
        lines.append(f"  step {step['step_s_at_mfu_full_overlap'] * 1e3:.1f} ms .. "
                     f"{step['step_s_at_mfu_no_overlap'] * 1e3:.1f} ms at MFU {mfu:.0%} of that rate (--mfu)")
    return lines


def _host_lines(host: dict) -> list[str]:
    line = (f"Host memory, rank 0's machine ({host['ranks_per_machine']} ranks): {human(host['peak_bytes'])} at "
            f"'{host['phase']}'; {human(host['host_memory_bytes'])} available ({host['host_memory_source']})")
    if host["fits"]:
        return [line + ": fits"]
    return [line + ": does NOT fit",
            "  load with fsdp_config cpu_ram_efficient_loading (rank 0 reads, the others receive their shards), "
            "run fewer ranks per machine, or give the machines' memory (--host-memory)"]


def plan_table(result: Plan) -> str:
    """The report as text: settings, the per-rank memory table, fit advice and step time."""
    s = result.settings
    fsdp = s["fsdp_config"]
    accum = s["gradient_accumulation_steps"]
    lines = [
        f"shardtrain plan: {result.model}",
        f"  {s['parallel']}; per-device batch {s['per_device_batch']} x seq {s['seq_len']}"
        f"{f' x {accum} micro-batches' if accum > 1 else ''}; mixed precision "
        f"{s['mixed_precision']}; {s['optimizer']}; LoRA rank {s['lora_rank'] or '-'}",
        f"  reshard_after_forward {fsdp['reshard_after_forward']}, activation_checkpointing "
        f"{fsdp['activation_checkpointing']}, cpu_offload {fsdp['cpu_offload']}; target {s['target']}",
        "",
        f"{'per rank (rank 0)':<32} {'memory':>11}  note",
    ]
    for row in result.rows:
        if row.name == "predicted peak":
            lines.append("-" * 60)
        lines.append(f"{row.name:<32} {human(row.bytes):>11}  {row.note}")
    if result.lifecycle:
        lines += ["", *_lifecycle_lines(result)]
    if result.fit is not None:
        lines += ["", *_fit_lines(result.fit)]
    if result.host is not None:
        lines += ["", *_host_lines(result.host)]
    if result.step is not None:
        lines += ["", *_step_lines(result.step)]
    return "\n".join(lines)
