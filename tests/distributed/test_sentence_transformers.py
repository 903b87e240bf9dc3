"""sentence-transformers' trainer on shardtrain's engine: the shipped MiniLM with CosineSimilarityLoss on two
FSDP2 ranks gives, step by step, the losses of sentence-transformers' own trainer on one process (its collator,
its loss module and its batch order; `workers/sentence_pairs.py`). The model `save_model` writes (through
sentence-transformers' own `_save`, honoured on rank 0) loads with `SentenceTransformer(path)` and embeds as the
model sentence-transformers' trainer saved."""

from pathlib import Path

import pytest
from launch import read_json, reference_and_two_ranks

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
