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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peer_imports import copy_rewritten, rewrite  # noqa: E402

SWAPPED = {f"{k}{s}" for k in ("SFT", "DPO", "GRPO", "RLOO", "KTO", "Reward") for s in ("Trainer", "Config")}


def swapped(node: ast.ImportFrom) -> list[ast.alias]:
    return [a for a in node.names if node.module == "trl" and a.name in SWAPPED and a.asname is None]


def swap_line(ind: str, names: list[str]) -> str:
    return f"{ind}from shardtrain.trl import {', '.join(names)}  # peer_trl swap\n"


def main(src: str, dst: str, *flags: str) -> None:
    swap = swapped if "--shardtrain" in flags else None
    copy_rewritten(src, dst, lambda text: rewrite(text, package="trl", marker="peer_trl", swap=swap,
                                                  swap_line=swap_line))


if __name__ == "__main__":
    main(*sys.argv[1:])
