"""Context-parallel attention (2 ranks, gloo) equals attention over the whole sequence, forward and backward."""

import json
from pathlib import Path

import pytest
from launch import torchrun

WORKER = Path(__file__).parent / "workers" / "cp_attention.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_attention")
    torchrun(WORKER, 2, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_attention_forward_and_backward_equal_full_attention(ranks):
    cases = [case for rank in ranks for case in rank["attention"]]
    assert len(cases) == 16
    assert {(c["load_balance"], c["causal"], c["window"], c["recompute"]) for c in cases} == {
        (lb, causal, window, recompute) for lb in (True, False)
        for causal, window, recompute in ((True, None, False), (True, 5, False), (False, None, False),
                                          (True, None, True))}
    for case in cases:
        assert case["grad_scale"] > 0.1  # the gradients compared are not all zero
        for key in ("out", "dq", "dk", "dv"):
            assert case[key] < 1e-5, case


@pytest.mark.parametrize("model", ["llama", "qwen2", "llama_packed"])
def test_models_split_over_cp_give_the_full_loss_gradients_and_logits(ranks, model):
    length = 13 if model == "llama_packed" else 11  # padded to 16 / 12 (2 x cp chunks), cut back
    for rank in ranks:
        case = next(c for c in rank["models"] if c["model"] == model)
        assert case["loss"] == pytest.approx(case["ref_loss"], abs=1e-4, rel=1e-6)
        assert case["grad_diff"] < 1e-5
        assert case["logits_shape"] == case["ref_logits_shape"] == [1 if model == "llama_packed" else 3, length, 64]
        assert case["logits_diff"] < 1e-5


def test_packed_documents_do_not_see_each_other_under_cp(ranks):
    for rank in ranks:
        case = next(c for c in rank["models"] if c["model"] == "llama_packed")
        assert case["document_gap"] < 1e-5


def test_unimplemented_attention_features_are_refused(ranks):
    for rank in ranks:
        assert "passes 's_aux' to its attention" in rank["refusals"]["sinks"]
