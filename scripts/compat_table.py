"""Print (or, with --write, update in README.md) the Hugging Face compatibility tables: TrainingArguments' fields
and transformers.Trainer's methods.

    .venv/bin/python scripts/compat_table.py           # print them
    .venv/bin/python scripts/compat_table.py --write   # replace the tables between the README's markers

The tables are generated from `shardtrain.train.arguments` / `hf_compat` (fields) and `hf_methods` (methods);
tests/unit/test_compat_table.py and test_hf_methods.py fail when README.md and the code disagree.
"""

import sys
from pathlib import Path

from shardtrain import Trainer
from shardtrain.train.arguments import compatibility_markdown
from shardtrain.train.hf_methods import methods_table

README = Path(__file__).resolve().parents[1] / "README.md"
TABLES = {"compat-table": compatibility_markdown, "methods-table": lambda: methods_table(set(vars(Trainer)))}


def readme_with_table(text: str) -> str:
    """`text` with the part between each table's markers replaced by the current table."""
    for name, render in TABLES.items():
        start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->\n"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + start + render() + end + tail
    return text


if __name__ == "__main__":
    if "--write" in sys.argv:
        README.write_text(readme_with_table(README.read_text()))
    else:
        print("".join(render() for render in TABLES.values()), end="")
