"""Print (or, with --write, update in README.md) the TrainingArguments compatibility table.

    .venv/bin/python scripts/compat_table.py           # print it
    .venv/bin/python scripts/compat_table.py --write   # replace the table between the README's markers

The table is generated from `shardtrain.train.arguments` and `hf_compat`; tests/unit/test_compat_table.py
fails when README.md and the code disagree.
"""

import sys
from pathlib import Path

from shardtrain.train.arguments import compatibility_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- compat-table:start -->\n", "<!-- compat-table:end -->\n"


def readme_with_table(text: str) -> str:
    """`text` with the part between the markers replaced by the current table."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + START + compatibility_markdown() + END + tail


if __name__ == "__main__":
    if "--write" in sys.argv:
        README.write_text(readme_with_table(README.read_text()))
    else:
        print(compatibility_markdown(), end="")
