"""sentence-transformers' trainer on shardtrain's engine: the shipped MiniLM with CosineSimilarityLoss on two
FSDP2 ranks gives, step by step, the losses of sentence-transformers' own trainer on one process (its collator,
its loss module and its batch order; `workers/sentence_pairs.py`). The model `save_model` writes (through
sentence-transformers' own `_save`, honoured on rank 0) loads with `SentenceTransformer(path)` and embeds as the
model sentence-transformers' trainer saved."""

from pathlib import Path

import numpy as np
import pytest
from launch import python, read_json, reference_and_two_ranks, torchrun

WORKER = Path(__file__).parent / "workers" / "sentence_pairs.py"


def test_two_ranks_equal_sentence_transformers_on_one_process(tmp_path):
    reference_and_two_ranks(WORKER, tmp_path, "st")
    theirs, ours = read_json(tmp_path / "st" / "pairs.json"), read_json(tmp_path / "ours" / "pairs.json")
    assert len(ours["losses"]) == 6 and ours["losses"][-1] < ours["losses"][0]
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-5)
    assert "modules.json" in ours["saved"] and ours["saved"] == theirs["saved"]
    assert len(ours["embeddings"]) == len(theirs["embeddings"]) == 2
    for mine, reference in zip(ours["embeddings"], theirs["embeddings"], strict=True):
        assert mine == pytest.approx(reference, abs=1e-5)


TRAINERS = Path(__file__).parent / "workers" / "st_trainers.py"
EVAL_FORMS = Path(__file__).parent / "workers" / "eval_forms.py"
# SPLADE's loss is ~2000 (dot products of unnormalised sparse vectors): fp32 rounding is relative there
TOLERANCE = {"mnrl": dict(abs=1e-5), "cross": dict(abs=1e-5), "sparse": dict(rel=5e-5)}


@pytest.mark.parametrize("case", ["mnrl", "triplet", "cross", "sparse"])
def test_each_trainer_on_two_ranks_equals_sentence_transformers(tmp_path, case):
    """Two FSDP2 ranks against sentence-transformers' own trainer on one process (`workers/st_trainers.py`):
    - the global batches its samplers draw (NO_DUPLICATES and round-robin over two datasets for mnrl,
      GROUP_BY_LABEL for triplet, the default for the others) are the one process's, split over the ranks;
    - where the loss is defined over the global batch (MNRL with gather_across_devices, a CrossEncoder's BCE,
      SPLADE's ranking loss with gathering and no regulariser) the losses and the saved model's outputs are its;
      BatchHardTripletLoss has no gathering, so each rank's triplets are its own, as under sentence-transformers."""
    python(TRAINERS, "st", case, str(tmp_path / "st"))
    torchrun(TRAINERS, 2, "ours", case, str(tmp_path / "ours"))
    theirs, ours = read_json(tmp_path / "st" / "result.json"), read_json(tmp_path / "ours" / "result.json")
    batches = read_json(tmp_path / "st" / "batches-0.json")
    rank0, rank1 = (read_json(tmp_path / "ours" / f"batches-{r}.json") for r in (0, 1))
    assert len(batches) == len(rank0) == len(rank1) == 4
    for step, (whole, first, second) in enumerate(zip(batches, rank0, rank1, strict=True)):
        assert len(first) == len(second) == 4, step
        assert sorted(first + second) == sorted(whole), f"step {step + 1} drew other samples"
    assert ours["saved"] == theirs["saved"] and "modules.json" in ours["saved"]
    if case == "triplet":
        return
    assert ours["losses"] == pytest.approx(theirs["losses"], **TOLERANCE[case])
    assert ours["losses"][0] != ours["losses"][-1]  # it trained
    assert np.asarray(ours["outputs"]) == pytest.approx(np.asarray(theirs["outputs"]), abs=2e-3 if case == "sparse"
                                                        else 1e-5)


def test_every_evaluation_set_form_evaluates_as_the_library_does(tmp_path):
    """A dataset, a stream and a dict of both as eval_dataset, evaluated during training and by evaluate():
    sentence-transformers' trainer (its model's forward names no label: transformers' `label_names` rule gives
    none, and evaluation goes through its compute_loss) and the plain Trainer, each against its library's own."""
    for mode in ("st", "hf", "ours"):
        python(EVAL_FORMS, mode, str(tmp_path / mode))
    ours, st, hf = (read_json(tmp_path / mode / "eval.json") for mode in ("ours", "st", "hf"))
    for name, reference in [*st.items(), *((f"trainer/{k}", v) for k, v in hf["trainer"].items())]:
        mine = ours["trainer"][name.split("/")[1]] if name.startswith("trainer/") else ours[name]
        assert mine["label_names"] == reference["label_names"], name
        assert [sorted(h) for h in mine["logged"]] == [sorted(h) for h in reference["logged"]], name
        for logged, expected in zip(mine["logged"], reference["logged"], strict=True):
            assert logged == pytest.approx(expected, abs=1e-5), name
        assert mine["returned"] == pytest.approx(reference["returned"], abs=1e-5), name
    assert st["dataset"]["label_names"] == [] and len(st["dict"]["logged"]) == 4
