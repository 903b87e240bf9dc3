"""The unchanged pipeline after the import switch: a collator holding the tokenizer and no processing_class, as
the usual script passes them; transformers writes the tokenizer (and its chat template) into every checkpoint and
into save_model's directory, and `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` read them back. Ours,
on one process and on 2 FSDP ranks, writes the same files and reloads to the same tokens, template and logits."""

import json
from pathlib import Path

import pytest
from launch import python, torchrun

WORKER = Path(__file__).parent / "workers" / "tokenizer_pipeline.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizer")
    python(WORKER, "hf", str(root / "hf"))
    python(WORKER, "ours", str(root / "ours"))
    torchrun(WORKER, 2, "ours", str(root / "ours2"))
    return {name: json.loads((root / name / "result.json").read_text()) for name in ("hf", "ours", "ours2")}


@pytest.mark.parametrize("run", ["ours", "ours2"])
@pytest.mark.parametrize("where", ["checkpoint-2", "final"])
def test_the_tokenizer_is_saved_and_found_where_transformers_puts_it(runs, run, where):
    hf, ours = runs["hf"][where], runs[run][where]
    assert "tokenizer.json" in hf["files"] and "tokenizer_config.json" in hf["files"]
    assert ours["files"] == hf["files"]
    assert ours["ids"] == hf["ids"] and ours["chat"] == hf["chat"] == "<user> w4 "
    assert ours["logits_sum"] == pytest.approx(hf["logits_sum"], abs=1e-3)
