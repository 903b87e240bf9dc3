"""Checkpoints move both ways between transformers' Trainer and shardtrain's (`workers/hf_checkpoints.py`).

One full batch of a tiny tied-embedding Llama, 8 steps, a checkpoint every 4. Each trainer runs uninterrupted;
then each resumes the other's checkpoint-4 (shardtrain also on 2 FSDP ranks) and must end where the trainer that
wrote the checkpoint ends: weights, and the losses and learning rates of steps 5-8, within 1e-5. A plain run (no
FSDP) resumes its own checkpoint bit for bit; a full checkpoint of an FSDP run resumes without FSDP.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from launch import python, torchrun, worker_env
from safetensors.torch import load_file

from shardtrain.checkpoint.full import write_full_checkpoint
from shardtrain.cli.main import main

WORKER = Path(__file__).parent / "workers" / "hf_checkpoints.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_checkpoints")
    python(WORKER, "ours", str(root / "ours"))
    python(WORKER, "hf", str(root / "hf"))
    python(WORKER, "ours", str(root / "ours_resumed"), str(root / "ours" / "checkpoint-4"))
    python(WORKER, "ours", str(root / "ours_from_hf"), str(root / "hf" / "checkpoint-4"))
    python(WORKER, "hf", str(root / "hf_from_ours"), str(root / "ours" / "checkpoint-4"))
    torchrun(WORKER, 2, "ours", str(root / "fsdp2_from_hf"), str(root / "hf" / "checkpoint-4"))
    torchrun(WORKER, 2, "ours", str(root / "fsdp2"))
    torchrun(WORKER, 2, "ours", str(root / "fsdp2_sharded"), env=worker_env(STATE_DICT_TYPE="SHARDED_STATE_DICT"))
    for run in ("fsdp2", "fsdp2_sharded"):  # exported to transformers' layout, resumed by transformers' Trainer
        exported = root / f"{run}_exported" / "checkpoint-4"
        assert main(["merge", "--hf-checkpoint", str(root / run / "checkpoint-4"), str(exported)]) == 0
        python(WORKER, "hf", str(root / f"hf_from_{run}"), str(exported))
    plain = python(WORKER, "ours", str(root / "plain_from_fsdp2"), str(root / "fsdp2" / "checkpoint-4"))
    (root / "plain_from_fsdp2" / "stderr.txt").write_text(plain.stderr)
    # our checkpoint-4 with its model rewritten as shards and an index after it was written (as transformers'
    # own tests do): the files listed in its manifest are gone, the ones there now are read instead
    resharded = root / "resharded" / "checkpoint-4"
    shutil.copytree(root / "ours" / "checkpoint-4", resharded)
    weights = load_file(resharded / "model.safetensors")
    (resharded / "model.safetensors").unlink()
    assert len(write_full_checkpoint(weights, resharded, None, max_shard_bytes=8_000)) > 2
    python(WORKER, "ours", str(root / "ours_from_resharded"), str(resharded))
    half = python(WORKER, "ours", str(root / "ours_half"), str(root / "ours" / "checkpoint-4"), "half")
    (root / "ours_half" / "stderr.txt").write_text(half.stderr)
    return root


def result(root: Path, name: str) -> dict:
    return json.loads((root / name / "result.json").read_text())


def weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(root / name / "final" / "model.safetensors")


def assert_ends_alike(root: Path, got: str, reference: str, tol: float) -> None:
    ours, ref = result(root, got), result(root, reference)
    assert ours["global_step"] == ref["global_step"] == 8
    assert ours["steps"] == ref["steps"] == list(range(1, 9))  # the history before the checkpoint came with it
    assert ours["losses"][4:] == pytest.approx(ref["losses"][4:], abs=tol, rel=0)
    assert ours["lrs"] == pytest.approx(ref["lrs"], abs=1e-12)  # the scheduler was restored
    a, b = weights(root, got), weights(root, reference)
    assert set(a) == set(b)
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= tol, f"{got} vs {reference}: weights differ by {worst}"


def test_a_plain_run_writes_hugging_faces_files(runs):
    names = {p.name for p in (runs / "ours" / "checkpoint-4").iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "training_args.bin", "shardtrain_state.json", "manifest.json"} <= names
    assert "optimizer" not in names  # no DCP directory


def test_a_plain_run_resumes_its_own_checkpoint_bit_for_bit(runs):
    assert_ends_alike(runs, "ours_resumed", "ours", tol=0.0)


def test_a_checkpoint_whose_model_was_split_into_shards_afterwards_resumes(runs):
    assert (runs / "resharded" / "checkpoint-4" / "model.safetensors.index.json").is_file()
    assert_ends_alike(runs, "ours_from_resharded", "ours", tol=0.0)


def test_transformers_checkpoint_resumes_on_one_process(runs):
    assert_ends_alike(runs, "ours_from_hf", "hf", tol=1e-5)


def test_transformers_checkpoint_resumes_on_two_fsdp_ranks(runs):
    assert_ends_alike(runs, "fsdp2_from_hf", "hf", tol=1e-5)


def test_transformers_resumes_a_plain_run_of_ours(runs):
    assert_ends_alike(runs, "hf_from_ours", "ours", tol=1e-5)


def test_a_full_fsdp_checkpoint_resumes_without_fsdp(runs):
    assert_ends_alike(runs, "plain_from_fsdp2", "fsdp2", tol=1e-5)


@pytest.mark.parametrize("run", ["fsdp2", "fsdp2_sharded"])
def test_transformers_resumes_an_exported_fsdp_checkpoint_with_its_optimizer(runs, run):
    """`shardtrain merge --hf-checkpoint` of a 2-rank FSDP checkpoint (full or sharded): transformers' one-process
    Trainer resumes it and ends where the FSDP run ended (its Adam moments, scheduler and step restored)."""
    names = {p.name for p in (runs / f"{run}_exported" / "checkpoint-4").iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= names
    assert not names & {"manifest.json", "shardtrain_state.json", "sharded", "optimizer"}
    assert_ends_alike(runs, f"hf_from_{run}", "fsdp2", tol=1e-5)


def test_the_same_global_batch_on_other_ranks_resumes_without_a_batch_warning(runs):
    """2 ranks x 4 resumed on 1 process x 8: the same global batch, an exact resume; Hugging Face's per-device
    batch warning would be noise there."""
    said = (runs / "plain_from_fsdp2" / "stderr.txt").read_text()
    assert "per_device_train_batch_size" not in said and "global batch" not in said
    assert result(runs, "plain_from_fsdp2")["global_step"] == 8


def test_another_global_batch_goes_on_with_a_warning_as_transformers_does(runs):
    said = (runs / "ours_half" / "stderr.txt").read_text()
    assert "was trained with a global batch of 8 samples, this run has 4" in said
    assert "per_device_train_batch_size: 4 (from args) != 8 (from trainer_state.json)" in said  # Hugging Face's
    assert result(runs, "ours_half")["global_step"] == 8


def test_transformers_reads_every_trainer_state_we_write(runs):
    states = sorted(runs.glob("*/checkpoint-*/trainer_state.json"))
    ours = [p for p in states if not p.parent.parent.name.startswith("hf")
            and not p.parent.parent.name.endswith("_exported")]  # those are transformers' layout
    assert len(ours) >= 8
    for path in ours:
        state = transformers.TrainerState.load_from_json(str(path))
        engine = json.loads((path.parent / "shardtrain_state.json").read_text())
        assert state.global_step == int(path.parent.name.split("-")[1])
        batch = 4 if path.parent.parent.name == "ours_half" else 8
        assert engine["global_batch_size"] == batch and engine["steps_per_epoch"] == 8 // batch
