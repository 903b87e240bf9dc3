"""N-rank FSDP2 training equals one-process training on the same global batch (losses and weights)."""

import json
from pathlib import Path

import pytest
import torch
from launch import python, torchrun

WORKER = Path(__file__).parent / "workers" / "fsdp_equivalence.py"
CASES = {
    "default": {},
    "reshard_false": {"reshard_after_forward": False},
    "activation_checkpointing": {"activation_checkpointing": True},
    "selective_checkpointing": {"activation_checkpointing": "selective"},
    "size_based": {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000},
    "no_wrap": {"auto_wrap_policy": "NO_WRAP"},
    "no_shard": {"fsdp_sharding_strategy": "no_shard"},
    "cpu_offload": {"cpu_offload": True},
    "output_unit": {"output_unit": True},
    "output_unit_checkpointing": {"output_unit": True, "activation_checkpointing": True},
    "tied": {},
    "tied_checkpointing": {"activation_checkpointing": True, "reshard_after_forward": False},
    "native_reduce_scatter": {"_env": {"SHARDTRAIN_GLOO_REDUCE_SCATTER": "native"}},
    "forward_prefetch": {"forward_prefetch": True},
    "forward_prefetch_head_checkpointing": {"forward_prefetch": "true", "output_unit": True,
                                            "activation_checkpointing": True},
}
FOUR_RANK_ONLY = {"hybrid_shard": {"sharding_strategy": "hybrid_shard", "dp_shard_size": 2},
                  "hybrid_shard_zero2": {"sharding_strategy": 5, "dp_shard_size": 2}}
TWO_RANK_ONLY = {"bf16": {"mixed_precision": "bf16"}}
# attention dropout: rank slices draw other masks than one process would, so these compare at one world size
DROPOUT = {"dropout": {}, "dropout_selective": {"activation_checkpointing": "selective"},
           "dropout_full": {"activation_checkpointing": "full"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("equiv")
    python(WORKER, str(root / "ref"), json.dumps({"plain": None, "plain_tied": None, **DROPOUT}))
    torchrun(WORKER, 2, str(root / "n2"), json.dumps({**CASES, **TWO_RANK_ONLY, **DROPOUT}))
    torchrun(WORKER, 4, str(root / "n4"), json.dumps({**CASES, **FOUR_RANK_ONLY}))
    return root


def _load(root: Path, run: str, case: str) -> tuple[dict, dict]:
    return json.loads((root / run / f"{case}.json").read_text()), torch.load(root / run / f"{case}.pt")


@pytest.mark.parametrize("world,case", [(2, c) for c in CASES] + [(4, c) for c in {**CASES, **FOUR_RANK_ONLY}])
def test_matches_single_process(runs, world, case):
    ref_name = "plain_tied" if "tied" in case else "plain"
    ref, ref_weights = _load(runs, "ref", ref_name)
    got, weights = _load(runs, f"n{world}", case)
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
    assert ref["losses"][-1] != ref["losses"][0]  # the weights did move
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        # AdamW divides by sqrt(v): where a gradient is tiny, matmul rounding (other per-rank shapes at 4 ranks)
        # moves a weight by up to ~2e-5 after the run (measured: one element of 2048, the same on the commit before)
        torch.testing.assert_close(weights[key], ref_weights[key], atol=1e-5 if world == 2 else 5e-5, rtol=0, msg=key)
    assert got["tied"] == ("tied" in case)
    assert got["generated"] == ref["generated"]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", ["dropout_selective", "dropout_full"])
def test_checkpointing_with_dropout_equals_none(runs, world, case):
    """Selective and full checkpointing recompute dropout from the stashed RNG state: the same masks, so the same
    losses and weights as without checkpointing (FSDP2 on 1 and 2 ranks)."""
    run = "ref" if world == 1 else f"n{world}"
    ref, ref_weights = _load(runs, run, "dropout")
    got, weights = _load(runs, run, case)
    plain, _ = _load(runs, "ref", "plain")
    assert ref["losses"][0] != pytest.approx(plain["losses"][0], abs=1e-4)  # dropout really drew masks
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6, rel=0)
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], atol=1e-6, rtol=0, msg=key)


@pytest.mark.parametrize("world,case", [(2, "default"), (4, "default"), (2, "tied"), (4, "hybrid_shard")])
def test_parameter_memory_is_one_over_n(runs, world, case):
    got, _ = _load(runs, f"n{world}", case)
    shard_ways = 2 if case.startswith("hybrid") else world
    assert got["local_numels"] == [got["full_numel"] // shard_ways] * world


def test_no_shard_replicates(runs):
    got, _ = _load(runs, "n2", "no_shard")
    assert got["local_numels"] == [got["full_numel"]] * 2


def test_bf16_close_to_fp32(runs):
    ref, _ = _load(runs, "ref", "plain")
    got, _ = _load(runs, "n2", "bf16")
    assert got["losses"] == pytest.approx(ref["losses"], abs=5e-3)
    assert got["losses"] != ref["losses"]  # really ran in bf16


@pytest.mark.parametrize("case,units", [("default", 3), ("output_unit", 5), ("tied", 3), ("no_wrap", 1)])
def test_fsdp_units(runs, case, units):
    """FSDP modules: 2 decoder layers + root; norm and lm_head (one unit, two modules) only when asked for,
    since this head is smaller than a layer."""
    got, _ = _load(runs, "n2", case)
    assert got["fsdp_modules"] == units


@pytest.mark.parametrize("case,layer_gathered", [("default", False), ("reshard_false", True)])
def test_root_stays_gathered_between_forward_and_backward(runs, case, layer_gathered):
    """The root (embedding) is not freed after forward and all-gathered again for backward; layers follow
    reshard_after_forward."""
    got, _ = _load(runs, "n2", case)
    assert got["gathered_after_forward"] == {"embedding (root)": True, "layer 0": layer_gathered}


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_reduce_scatter_is_an_all_to_all_and_matches_gloos_own(runs, world):
    """On gloo, FSDP2 reduces gradients with an all-to-all and a sum (parallel/gloo_comms.py) unless
    SHARDTRAIN_GLOO_REDUCE_SCATTER=native; both give one process's training (test above), and on 2 ranks the same
    bits as gloo's reduce-scatter (a + b either way), on 4 the same to float rounding (another summation order,
    amplified by AdamW over the steps: the tolerance of the one-process comparison)."""
    got, weights = _load(runs, f"n{world}", "default")
    native, native_weights = _load(runs, f"n{world}", "native_reduce_scatter")
    assert got["reduce_scatter"] == ["AllToAllReduceScatter"]
    assert native["reduce_scatter"] == ["DefaultReduceScatter"]
    if world == 2:
        assert got["losses"] == native["losses"]
        assert all(torch.equal(weights[k], native_weights[k]) for k in weights)
    else:
        assert got["losses"] == pytest.approx(native["losses"], abs=1e-5, rel=0)
        for key in weights:
            torch.testing.assert_close(weights[key], native_weights[key], atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize("case,expected", [
    ("default", [[0, 0]] * 3),
    # root -> layer 0 -> layer 1 in forward; layer 1 -> layer 0 in backward (the root is gathered throughout)
    ("forward_prefetch", [[1, 0], [1, 0], [0, 1]]),
    # ... -> layer 1 -> head in forward, head -> layer 1 -> layer 0 in backward; the head unit's final norm and
    # lm_head share one FSDP state, listed for each
    ("forward_prefetch_head_checkpointing", [[1, 0], [1, 0], [1, 1], [0, 1], [0, 1]]),
])
def test_forward_prefetch_links_each_unit_to_the_next(runs, case, expected):
    """`forward_prefetch` sets FSDP2's explicit prefetch along the units (root first, head last); the losses equal one
    process's (test_matches_single_process)."""
    got, _ = _load(runs, "n2", case)
    assert got["prefetches"] == expected
