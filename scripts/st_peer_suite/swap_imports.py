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
import importlib
import re
import shutil
import sys
import warnings
from pathlib import Path

SWAPPED = {f"{k}{s}" for k in ("SentenceTransformer", "CrossEncoder", "SparseEncoder", "MultiVectorEncoder")
           for s in ("Trainer", "TrainingArguments")}
SHARDTRAIN = "shardtrain.sentence_transformers"


def missing(module: str, name: str) -> bool:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return True
    if hasattr(mod, name):
        return False
    try:
        importlib.import_module(f"{module}.{name}")
        return False
    except ImportError:
        return True


def swap_line(ind: str, names: list[str]) -> str:
    targets = ", ".join(names) + ("," if len(names) == 1 else "")
    quoted = ", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else "")
    return (f'{ind}{targets} = (getattr(__import__("{SHARDTRAIN}", fromlist=["*"]), _n, None) '
            f"for _n in ({quoted}))  # peer_st swap\n")


def rewrite(text: str, swap: bool) -> tuple[str, list[str]]:
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line) replaced by text, 1-based inclusive
    notes = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0
                and (node.module or "").split(".")[0] == "sentence_transformers"):
            continue
        ind = " " * node.col_offset
        absent = [a for a in node.names if a.name != "*" and missing(node.module, a.name)]
        swapped = sorted(a.name for a in node.names if swap and a.name in SWAPPED and a.asname is None
                         and a not in absent)
        if not absent and not swapped:
            continue
        new = "".join(lines[node.lineno - 1 : node.end_lineno])  # kept verbatim when nothing is absent
        if absent:
            kept = [a for a in node.names if a not in absent]
            new = ""
            if kept:
                names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
                new += f"{ind}from {node.module} import {names}\n"
            for a in absent:
                bound = a.asname or a.name
                m = re.fullmatch(r"is_(\w+)_available", a.name)
                found = f'__import__("importlib.util").util.find_spec("{m.group(1)}") is not None' if m else None
                value = f"lambda: {found}" if found else "None"
                new += f"{ind}{bound} = {value}  # peer_st: {node.module}.{a.name} absent from the installed package\n"
                notes.append(f"line {node.lineno}: {node.module}.{a.name} absent -> {value.split(':')[0]}")
        if swapped:
            new += swap_line(ind, swapped)
            notes.append(f"line {node.end_lineno}: {', '.join(swapped)} <- {SHARDTRAIN}")
        edits.append((node.lineno, node.end_lineno, new))
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1 : last] = [new]
    return "".join(lines), notes


def main(src: str, dst: str, *flags: str) -> None:
    warnings.simplefilter("ignore")  # the deprecated import paths the tests use (sentence_transformers.models, ...)
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists():
        shutil.rmtree(dst_p)
    shutil.copytree(src_p, dst_p, symlinks=True)
    for path in sorted(dst_p.rglob("*.py")):
        new, notes = rewrite(path.read_text(), "--shardtrain" in flags)
        if notes:
            path.write_text(new)
            for n in notes:
                print(f"{path.relative_to(dst_p)}: {n}")


if __name__ == "__main__":
    main(*sys.argv[1:])
