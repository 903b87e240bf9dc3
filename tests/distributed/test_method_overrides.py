"""A subclass overriding the methods the engine honours (`workers/method_overrides.py`), on 2 ranks beside the same
subclass of transformers' Trainer: the sampler's order gives every rank the same samples as under Hugging Face,
predictions come back in the evaluation sampler's order, `_save` runs on rank 0 with the whole model,
`_load_optimizer_and_scheduler` runs on resume and reads the file its `_save_checkpoint` wrote, and a resume inside
an epoch of an overridden `get_train_dataloader` reads the batches that `get_resumed_dataloader` returns
(transformers >= 5.25; before, neither Trainer calls it)."""

from pathlib import Path

import pytest
import transformers
from launch import read_json, torchrun

WORKER = Path(__file__).parent / "workers" / "method_overrides.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("overrides")
    for mode in ("hf", "ours"):
        torchrun(WORKER, 2, mode, str(root / mode))
    return {mode: [read_json(root / mode / f"rank{rank}.json") for rank in (0, 1)] for mode in ("hf", "ours")}


def test_the_train_sampler_order_reaches_each_rank_as_under_hugging_face(runs):
    for ours, hf in zip(runs["ours"], runs["hf"]):
        assert ours["seen"] == hf["seen"]
        assert ours["counts"]["_get_train_sampler"] >= 1
    assert runs["ours"][0]["seen"] == [[8, 7], [4, 3]]  # rows 7 and 6 first: the reversed order


def test_predictions_follow_the_eval_sampler(runs):
    for ours, hf in zip(runs["ours"], runs["hf"]):
        assert ours["predicted_rows"] == hf["predicted_rows"] == [8, 7, 6, 5, 4, 3, 2, 1]
        assert ours["counts"]["_get_eval_sampler"] >= 1


def test_an_overridden_save_writes_the_whole_model_from_rank_0(runs):
    rank0, rank1 = runs["ours"]
    assert rank0["counts"]["_save"] == 1 and "_save" not in rank1["counts"]  # once, by the main process
    assert rank0["library_file"] == {"embedding_shape": [64, 32]}  # whole tensors, not shards
    assert rank0["saved_embedding_sum"] == pytest.approx(runs["hf"][0]["saved_embedding_sum"], abs=1e-5)


def test_load_optimizer_and_scheduler_runs_on_resume_with_the_checkpoint(runs):
    for ours in runs["ours"]:
        assert ours["counts"]["_load_optimizer_and_scheduler"] == 1
        assert ours["extra"] == {"step": 1}


def test_a_resume_inside_an_epoch_reads_what_get_resumed_dataloader_returns_as_under_hugging_face(runs):
    for rank, (ours, hf) in enumerate(zip(runs["ours"], runs["hf"])):
        assert ours["loader"] == hf["loader"]
        batches = [[rank + 1, rank + 3], [rank + 5, rank + 7], [rank + 9, rank + 11], [rank + 13, rank + 15]]
        assert ours["loader"]["trained"] == batches  # this rank's rows (first tokens), the 4 steps of the epoch
        if hasattr(transformers.Trainer, "get_resumed_dataloader"):
            # called once, with the 2 micro-batches of the finished steps; the loader it returns is read from its
            # start, so steps 3 and 4 train on the epoch's first two batches
            assert ours["loader"]["resumed_calls"] == [2]
            assert ours["loader"]["resumed"] == batches[:2]
        else:  # transformers < 5.25: the finished steps' batches are skipped
            assert ours["loader"]["resumed_calls"] == []
            assert ours["loader"]["resumed"] == batches[2:]
