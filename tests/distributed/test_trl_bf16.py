"""What bf16 means, side by side with TRL on one CPU process (the figures docs/trl.md quotes):
- without FSDP, shardtrain runs the model's forward under bf16 autocast as Accelerate does for transformers (after
  TRL's own patch of the forward, its fused LM head): TRL's bf16 losses, to float rounding;
- with FSDP2, bf16 is the parameters' dtype for compute with fp32 reductions (`MixedPrecisionPolicy`): close to
  TRL's autocast but not equal, by less than bf16's own distance from fp32 here."""

import json
from pathlib import Path

import pytest
from launch import python

WORKER = Path(__file__).parent / "workers" / "trl_bf16.py"
CASES = ("trl_fp32", "trl_bf16", "ours_bf16", "ours_fsdp_bf16")


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> dict[str, list[float]]:
    root = tmp_path_factory.mktemp("trl_bf16")
    for case in CASES:
        python(WORKER, case, str(root))
    return {case: json.loads((root / f"{case}.json").read_text()) for case in CASES}


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_bf16_without_fsdp_is_trls_autocast(losses):
    assert len(losses["trl_bf16"]) == 8
    assert gap(losses["trl_bf16"], losses["trl_fp32"]) > 1e-4  # bf16 really changed the numbers
    assert gap(losses["ours_bf16"], losses["trl_bf16"]) < 1e-6


def test_fsdp2_bf16_is_close_to_autocast_not_equal(losses):
    to_autocast = gap(losses["ours_fsdp_bf16"], losses["trl_bf16"])
    assert 0 < to_autocast < 2 * gap(losses["trl_bf16"], losses["trl_fp32"])
