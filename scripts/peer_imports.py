"""The import rewriting the client-library peer suites share (`scripts/trl_peer_suite`, `scripts/st_peer_suite`).

A library's test files come from a git checkout (its HEAD), the installed package is another version: a
`from <package>... import a, b` naming something the installed package lacks would stop the whole file from being
collected. Each such name is dropped from its import and bound right below it: `is_X_available` to a
find_spec("X") check, anything else to None (the tests that use it then fail on both sides and drop out).
With `swap`, the names a user's import line would take from shardtrain are rebound right after the import, at its
indentation and in its scope, by the line `swap_line(indent, names)` returns.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path


def missing(module: str, name: str) -> bool:
    """Whether the installed `module` lacks `name` (neither an attribute nor a submodule)."""
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


def rewrite(text: str, *, package: str, marker: str, swap: Callable[[ast.ImportFrom], list[str]] | None,
            swap_line: Callable[[str, list[str]], str]) -> tuple[str, list[str]]:
    """`text` with its imports from `package` adapted (see the module docstring); the notes of what changed.
    `swap(node)`: the names of that import to take from shardtrain (None: no swap); `marker` tags the lines
    written for absent names."""
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line) replaced by text, 1-based inclusive
    notes = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0
                and (node.module or "").split(".")[0] == package):
            continue
        ind = " " * node.col_offset
        absent = [a for a in node.names if a.name != "*" and missing(node.module, a.name)]
        swapped = sorted(a.name for a in (swap(node) if swap else []) if a not in absent)
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
                new += f"{ind}{bound} = {value}  # {marker}: {node.module}.{a.name} absent from the installed package\n"
                notes.append(f"line {node.lineno}: {node.module}.{a.name} absent -> {value.split(':')[0]}")
        if swapped:
            new += swap_line(ind, swapped)
            notes.append(f"line {node.end_lineno}: {', '.join(swapped)} <- shardtrain")
        edits.append((node.lineno, node.end_lineno, new))
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1 : last] = [new]
    return "".join(lines), notes


def copy_rewritten(src: str, dst: str, rewrite_text: Callable[[str], tuple[str, list[str]]]) -> None:
    """Copy the tree `src` to `dst` (replaced), each .py file through `rewrite_text`; print its notes."""
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists():
        shutil.rmtree(dst_p)
    shutil.copytree(src_p, dst_p, symlinks=True)
    for path in sorted(dst_p.rglob("*.py")):
        new, notes = rewrite_text(path.read_text())
        if notes:
            path.write_text(new)
            for n in notes:
                print(f"{path.relative_to(dst_p)}: {n}")
