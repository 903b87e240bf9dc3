"""The documentation's Hugging Face compatibility table (docs/hugging-face.md) is the one the code generates, and
it covers every field."""

import dataclasses
import importlib.util
from pathlib import Path

import transformers

from shardtrain import TrainingArguments
from shardtrain.train.arguments import compatibility_markdown

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compat_table", REPO / "scripts" / "compat_table.py")
compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat)


def test_documented_tables_match_the_code():
    for page, tables in compat.PAGES.items():
        text = (REPO / "docs" / page).read_text()
        assert compat.page_with_tables(text, tables) == text, \
            f"docs/{page}'s tables are stale: run .venv/bin/python scripts/compat_table.py --write"


def test_every_hugging_face_field_is_accepted_and_listed():
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    hf = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    assert hf <= ours
    table = compatibility_markdown()
    for name in hf:
        assert f"| `{name}` |" in table
