"""`manifest.json`: what a complete checkpoint holds, written last before the atomic rename.

It lists every file with its size, and a SHA-256 of each small file (JSON state, RNG states, DCP metadata),
so a checkpoint that was damaged after it was committed (a truncated shard, an edited or deleted file) is
recognised before anything is loaded from it. Large weight shards are checked by size only: hashing
gigabytes at every save would cost more than the save.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

MANIFEST_FILE = "manifest.json"
HASHED_MAX_BYTES = 1 << 20  # files up to this size get a checksum
FORMAT_VERSION = 1


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(directory: str | Path) -> None:
    """Record every file under `directory` (sizes; checksums of small files) in `directory/manifest.json`."""
    root = Path(directory)
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        size = path.stat().st_size
        entry: dict[str, int | str] = {"size": size}
        if size <= HASHED_MAX_BYTES:
            entry["sha256"] = _sha256(path)
        files[path.relative_to(root).as_posix()] = entry
    text = json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1, sort_keys=True)
    (root / MANIFEST_FILE).write_text(text)


def manifest_problem(directory: str | Path, skip: Callable[[str], bool] | None = None) -> str | None:
    """What is wrong with the checkpoint in `directory` compared with its manifest, or None when it matches
    (`skip`: file names the caller checks another way)."""
    root = Path(directory)
    manifest = root / MANIFEST_FILE
    if not manifest.is_file():
        return f"{MANIFEST_FILE} is missing (the checkpoint is incomplete, or was not written by shardtrain)"
    try:
        files = json.loads(manifest.read_text())["files"]
        items = [(str(name), int(entry["size"]), entry.get("sha256")) for name, entry in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST_FILE} is damaged ({type(err).__name__}: {err})"
    for name, size, digest in items:
        if skip is not None and skip(name):
            continue
        path = root / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
        if digest is not None and _sha256(path) != digest:
            return f"{name} does not match its checksum in {MANIFEST_FILE} (the file was modified or damaged)"
    return None


def listed_files(directory: str | Path) -> list[str]:
    """The files the manifest of `directory` lists (none when it is missing or damaged)."""
    try:
        return list(json.loads((Path(directory) / MANIFEST_FILE).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
