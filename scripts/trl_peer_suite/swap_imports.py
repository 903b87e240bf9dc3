# Run (prepare.sh does it): .venv/bin/python scripts/trl_peer_suite/swap_imports.py SRC_DIR DST_DIR [--shardtrain]
"""Copy TRL's extracted test tree, adapting imports; with --shardtrain also swap the trainers to shardtrain.trl.

Both sides (adaptation, identical for trl and st): the test files are TRL's HEAD, the installed trl is another
version, so a `from trl... import a, b` naming something the installed trl lacks would stop the whole file from
being collected. Each such name is dropped from its import and bound right below it: `is_X_available` to a
find_spec("X") check, anything else to None (the tests that use it then fail on both sides and drop out).

--shardtrain (the user's change of import line): right after every `from trl import ...` that imports any of
SWAPPED, one line `from shardtrain.trl import <those names>` at the same indentation rebinds them in the same
scope. Nothing else changes: collators, utils, mock.patch targets ("trl.trainer....") stay TRL's.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import sys
from pathlib import Path

SWAPPED = {f"{k}{s}" for k in ("SFT", "DPO", "GRPO", "RLOO", "KTO", "Reward") for s in ("Trainer", "Config")}


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


def rewrite(text: str, swap: bool) -> tuple[str, list[str]]:
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line) replaced by text, 1-based inclusive
    notes = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "trl"):
            continue
        ind = " " * node.col_offset
        absent = [a for a in node.names if a.name != "*" and missing(node.module, a.name)]
        swapped = sorted(a.name for a in node.names if swap and node.module == "trl" and a.name in SWAPPED
                         and a.asname is None and a not in absent)
        if not absent and not swapped:
            continue
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
            new += f"{ind}{bound} = {value}  # peer_trl: {node.module}.{a.name} absent from the installed trl\n"
            notes.append(f"line {node.lineno}: {node.module}.{a.name} absent -> {value.split(':')[0]}")
        if swapped:
            new += f"{ind}from shardtrain.trl import {', '.join(swapped)}  # peer_trl swap\n"
            notes.append(f"line {node.end_lineno}: from shardtrain.trl import {', '.join(swapped)}")
        edits.append((node.lineno, node.end_lineno, new))
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1 : last] = [new]
    return "".join(lines), notes


def main(src: str, dst: str, *flags: str) -> None:
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
