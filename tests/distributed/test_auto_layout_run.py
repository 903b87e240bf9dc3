"""`fsdp_config` "layout": "auto" on 2 ranks: the planner's pick is the fastest predicted layout that fits the budget,
the run applies it, and it trains with the default layout's losses (GPT-2 with dropout and tied embeddings, padded
samples); once a process group exists "auto" traces in a fresh process, with the same candidates."""

import importlib.util
import json
from pathlib import Path

import pytest
from launch import torchrun

WORKER = Path(__file__).parent / "workers" / "auto_layout.py"
# rules out every layout without activation checkpointing, and no_shard (the planner's peaks of this model: 705 KiB
# to 1.11 MiB)
BUDGET = 900 * 1024


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_layout")
    # not pooled: the pool's ranks start each case's process group first, and "auto" plans before it starts
    torchrun(WORKER, 2, str(out), str(BUDGET), pooled=False)
    return {**json.loads((out / "result.json").read_text()), "out": str(out)}


def test_pick_is_fastest_predicted_that_fits(result):
    choice = result["choice"]
    fits = [c for c in choice["candidates"] if c["fits"]]
    assert choice["budget_bytes"] == BUDGET and choice["budget_source"] == "fsdp_config max_memory_per_rank"
    # 3 shardings x 3 checkpointing modes, and no_shard as one unit (AC none); vocabulary 64: no loss chunk
    assert len(choice["candidates"]) == 10
    assert 0 < len(fits) < 10
    assert all(c["predicted_peak_bytes"] <= BUDGET for c in fits)
    picked = next(c for c in choice["candidates"] if c["name"] == choice["chosen"])
    assert picked["fits"]
    assert picked["predicted_step_s"] <= min(c["predicted_step_s"] for c in fits) * 1.02
    # which of those is fastest depends on this machine's measured rates; each of them checkpoints and shards
    assert picked["activation_checkpointing"] != "none" and picked["sharding"] != "no_shard"


def test_run_applies_the_pick(result):
    picked = next(c for c in result["choice"]["candidates"] if c["name"] == result["choice"]["chosen"])
    assert result["applied"] == {"replicate_only": False,
                                 "reshard_after_forward": picked["sharding"] == "full_shard",
                                 "activation_checkpointing": picked["activation_checkpointing"],
                                 "loss_chunk_size": None}


def test_losses_equal_the_default_layout(result):
    assert result["losses"] == pytest.approx(result["default_losses"], abs=1e-6, rel=0)
    assert len(result["losses"]) == 4 and len(set(result["losses"])) > 1


def test_after_the_process_group_started_the_fresh_process_traces_the_same_candidates(result):
    """The second auto run starts with the process group up (as TRL's trainers do): rank 0 traces in a fresh
    process that rebuilds the model from its config; the traces are deterministic, so they match the first run's."""
    traced = ("name", "predicted_peak_bytes", "ops", "collective_calls", "selective_ops", "units")
    assert result["group_was_up"]
    first, started = result["choice"]["candidates"], result["started_choice"]["candidates"]
    assert [{k: c[k] for k in traced} for c in started] == [{k: c[k] for k in traced} for c in first]
    assert result["started_losses"] == pytest.approx(result["default_losses"], abs=1e-6, rel=0)


def test_a_model_the_fresh_process_cannot_rebuild_stops_every_rank(result):
    """Only rank 0 describes the model; every rank raises its error (rank 1 would otherwise wait in a collective)."""
    out = Path(result["out"])
    for rank in (0, 1):
        said = (out / f"refused_{rank}.txt").read_text()
        assert "this model (Sequential) is not a transformers PreTrainedModel" in said
        assert "create the Trainer before the process group starts" in said


def test_no_layout_fits_stops_every_rank_before_training(tmp_path):
    out = tmp_path / "run"
    proc = torchrun(WORKER, 2, str(out), "1KiB", check=False, pooled=False)
    assert proc.returncode != 0  # both ranks ended (rank 1 raised the same error, which rank 0 prints)
    assert "no layout fits 1.00 KiB per rank (the smallest, " in proc.stderr
    assert "needs 705 KiB); raise max_memory_per_rank" in proc.stderr
    assert not (out / "auto").exists()  # stopped before the Trainer touched its output_dir



def test_a_pipeline_is_chosen_where_only_it_fits_and_trains_the_default_layouts_losses(tmp_path):
    """A Llama (a pipeline plan) on 2 ranks with a budget only a pipeline candidate fits: "auto" takes pp 2 x dp 1,
    twice the accumulation steps for the same global batch, and the losses of the default layout (dp 2)."""
    worker = Path(__file__).parent / "workers" / "auto_pipeline.py"
    spec = importlib.util.spec_from_file_location("auto_pipeline", worker)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    traced = module.candidates(2, tmp_path / "probe")  # what the run's rank 0 will trace (deterministic)
    least = min(traced, key=lambda c: c.peak)
    assert least.pp == 2 and all(c.peak > least.peak for c in traced if c.pp == 1), [(c.name, c.peak) for c in traced]
    torchrun(worker, 2, str(tmp_path), str(least.peak), pooled=False)
    result = json.loads((tmp_path / "result.json").read_text())
    choice = result["choice"]
    assert choice["chosen"] == least.name and choice["chosen"].startswith("pp 2, ")
    assert [c["name"] for c in choice["candidates"] if c["fits"]] == [least.name]
    assert {c["name"] for c in choice["candidates"]} == {c.name for c in traced}  # the data-parallel ones too
    assert result["layout"].startswith("pp 2 x") and result["pp"] == 2 and result["accumulation_factor"] == 2
    assert result["accumulation"] == [2, 1] and result["global_batch"] == [8, 8]
    assert len(result["losses"]) == 4 and len(set(result["losses"])) > 1
    assert result["losses"] == pytest.approx(result["default_losses"], rel=1e-5, abs=0)
