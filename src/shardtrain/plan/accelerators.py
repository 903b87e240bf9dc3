"""Known accelerators for `shardtrain plan --accelerator NAME`: peak dense throughput, memory, link rate.

    spec = ACCELERATORS["h100-sxm"]
    spec.tflops("bf16"), spec.memory_gib, spec.link_gbps

Figures are the vendors' datasheet peaks (dense: no 2:4 sparsity), per device; `link_gbps` is one direction of the
device's fastest link to its peers on the same machine (NVLink, Infinity Fabric, or PCIe where there is none).
A real step reaches a fraction of the compute peak (often 30-60 %), so a step time planned from this table is a
lower bound; pass `--tflops` with a rate you measured to plan closer.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.errors import PlanError


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One device's datasheet figures (dense TFLOP/s by dtype, memory, link)."""

    name: str
    bf16_tflops: float
    fp32_tflops: float
    memory_gib: float
    link_gbps: float
    link: str

    def tflops(self, precision: str) -> float:
        """Peak dense TFLOP/s of the step's matmul dtype ("bf16"/"fp16", else fp32 without tensor cores)."""
        return self.bf16_tflops if precision in ("bf16", "fp16") else self.fp32_tflops


ACCELERATORS = {spec.name: spec for spec in (
    Accelerator(name="h100-sxm", bf16_tflops=989, fp32_tflops=67, memory_gib=80, link_gbps=450, link="NVLink 4"),
    Accelerator(name="h100-pcie", bf16_tflops=756, fp32_tflops=51, memory_gib=80, link_gbps=64, link="PCIe 5"),
    Accelerator(name="h200", bf16_tflops=989, fp32_tflops=67, memory_gib=141, link_gbps=450, link="NVLink 4"),
    Accelerator(name="b200", bf16_tflops=2250, fp32_tflops=80, memory_gib=180, link_gbps=900, link="NVLink 5"),
    Accelerator(name="a100-80gb", bf16_tflops=312, fp32_tflops=19.5, memory_gib=80, link_gbps=300,
                link="NVLink 3"),
    Accelerator(name="a100-40gb", bf16_tflops=312, fp32_tflops=19.5, memory_gib=40, link_gbps=300,
                link="NVLink 3"),
    Accelerator(name="l40s", bf16_tflops=362, fp32_tflops=91.6, memory_gib=48, link_gbps=32, link="PCIe 4"),
    Accelerator(name="mi300x", bf16_tflops=1307, fp32_tflops=163, memory_gib=192, link_gbps=448,
                link="Infinity Fabric"),
)}


def accelerator(name: str) -> Accelerator:
    """The table's entry for `name` (case and `_`/`-` do not matter).

    Raises:
        PlanError: an unknown name, listing the known ones and the flags that replace the table.
    """
    key = name.strip().lower().replace("_", "-")
    if key not in ACCELERATORS:
        raise PlanError(f"--accelerator {name!r} is not in the table ({', '.join(ACCELERATORS)}); pick one, or give "
                        "the device's figures: --target cuda --device-memory 80GiB --tflops 400 --link-gbps 50")
    return ACCELERATORS[key]


def table() -> str:
    """The table as `shardtrain plan --help` prints it."""
    rows = [f"  {'name':<10} {'bf16 TFLOP/s':>12} {'fp32 TFLOP/s':>12} {'memory':>8}  link"]
    rows += [f"  {a.name:<10} {a.bf16_tflops:>12g} {a.fp32_tflops:>12g} {a.memory_gib:>5g} GiB  {a.link_gbps:g} GB/s "
             f"({a.link})" for a in ACCELERATORS.values()]
    return "\n".join(rows)
