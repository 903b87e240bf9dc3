"""`loss_chunk_size` on 2 FSDP2 ranks trains exactly like the unchunked loss: a 128k-vocabulary tiny Llama (its
head as its own FSDP unit, untied; and tied to the embedding, in the root unit), context parallelism, and
evaluate()/predict() (predictions need the logits: the unchunked path) — all in one launch."""

import json
from pathlib import Path

import pytest
import torch
from launch import assert_same_training, run_result, torchrun

WORKER = Path(__file__).parent / "workers" / "train_run.py"
# AdamW divides each gradient coordinate by its own running size: where a coordinate is ~0 (rows of tokens that
# never occur: their gradient is a sum of small terms of both signs) the fp32 rounding of a different summation
# order becomes a step of up to lr (1e-5 in a weight at eps 1e-8, 1.3e-6 at 1e-4). An eps of 1e-3 keeps those
# steps rounding-sized, so the final weights show the gradients' own agreement.
EXACT = {"adam_epsilon": 1e-3, "weights": True}
BIG = {"vocab": 128256, "per_device_train_batch_size": 4, **EXACT}
# name -> (reference job, job); chunk sizes that do not divide the micro-batches' token counts
PAIRS = {
    "untied": ({**BIG}, {**BIG, "loss_chunk_size": 48}),
    "tied": ({**BIG, "model": "llama_tied"}, {**BIG, "model": "llama_tied", "loss_chunk_size": 37}),
    "cp2": ({**BIG, "cp_size": 2, "per_device_train_batch_size": 8},
            {**BIG, "cp_size": 2, "per_device_train_batch_size": 8, "loss_chunk_size": 5}),
    "predict": ({"per_device_train_batch_size": 4, "predict": True, **EXACT},
                {"per_device_train_batch_size": 4, "predict": True, "loss_chunk_size": "auto", **EXACT}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    jobs = [{"out": str(root / f"{name}_{kind}"), **job}
            for name, pair in PAIRS.items() for kind, job in zip(("ref", "chunked"), pair, strict=True)]
    torchrun(WORKER, 2, json.dumps(jobs), timeout=900)
    return root


@pytest.mark.parametrize("name", list(PAIRS))
def test_chunked_training_equals_unchunked(runs, name):
    # losses (~11.8 for 128k tokens: 1 fp32 ulp is 9.5e-7) within 1e-6 relative; weights within 1e-6
    assert_same_training(runs, f"{name}_ref", f"{name}_chunked", tol=1.2e-5, weight_tol=1e-6)
    assert run_result(runs, f"{name}_ref")["layout"] == run_result(runs, f"{name}_chunked")["layout"]


def test_predictions_are_the_unchunked_logits(runs):
    ref = torch.load(runs / "predict_ref" / "predict.pt")
    got = torch.load(runs / "predict_chunked" / "predict.pt")
    torch.testing.assert_close(got["predictions"], ref["predictions"], rtol=0, atol=1e-6)
    assert got["metrics"]["test_loss"] == pytest.approx(ref["metrics"]["test_loss"], abs=1e-6)
