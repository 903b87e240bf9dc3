# Run (prepare.sh does it): .venv/bin/python scripts/st_peer_suite/swap_imports.py SRC_DIR DST_DIR [--shardtrain]
"""Copy sentence-transformers' extracted test tree, adapting imports; with --shardtrain also swap the trainers.

Both sides (adaptation, identical for sbert and shardtrain): the test files are the mirror's HEAD, the installed
sentence-transformers is another version, so a `from sentence_transformers... import a, b` naming something the
installed package lacks would stop the whole file from being collected. Each such name is dropped from its import
and bound right below it: `is_X_available` to a find_spec("X") check, anything else to None (the tests that use it
then fail on both sides and drop out).

--shardtrain (the user's change of import line): right after every `from sentence_transformers[.x.y] import ...`
that imports any of SWAPPED, one line at the same indentation rebinds those names, in the same scope, to
shardtrain.sentence_transformers' own:

    A, B = (getattr(__import__("shardtrain.sentence_transformers", fromlist=["*"]), _n, None)
            for _n in ("A", "B"))  # peer_st swap       (on one line)

A name shardtrain does not export (yet) becomes None there, so the tests using it fail on the shardtrain side
("'NoneType' object is not callable") instead of silently running sentence-transformers' class; a failing import
of shardtrain.sentence_transformers itself fails the file. Nothing else changes: models, losses, collators,
samplers, evaluators, mock targets stay sentence-transformers'.
"""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peer_imports import copy_rewritten, rewrite  # noqa: E402

SWAPPED = {f"{k}{s}" for k in ("SentenceTransformer", "CrossEncoder", "SparseEncoder", "MultiVectorEncoder")
           for s in ("Trainer", "TrainingArguments")}
SHARDTRAIN = "shardtrain.sentence_transformers"


def swapped(node: ast.ImportFrom) -> list[ast.alias]:
    return [a for a in node.names if a.name in SWAPPED and a.asname is None]


def swap_line(ind: str, names: list[str]) -> str:
    targets = ", ".join(names) + ("," if len(names) == 1 else "")
    quoted = ", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else "")
    return (f'{ind}{targets} = (getattr(__import__("{SHARDTRAIN}", fromlist=["*"]), _n, None) '
            f"for _n in ({quoted}))  # peer_st swap\n")


def main(src: str, dst: str, *flags: str) -> None:
    warnings.simplefilter("ignore")  # the deprecated import paths the tests use (sentence_transformers.models, ...)
    swap = swapped if "--shardtrain" in flags else None
    copy_rewritten(src, dst, lambda text: rewrite(text, package="sentence_transformers", marker="peer_st",
                                                  swap=swap, swap_line=swap_line))


if __name__ == "__main__":
    main(*sys.argv[1:])
