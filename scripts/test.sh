#!/usr/bin/env bash
# Set up the venvs if needed (.venv, and the XLA one: scripts/setup_xla.sh), build the documentation (strict: a
# broken link, a missing page or a documented symbol that is gone fails), then run the whole test suite on CPU.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the TPU path's tests (tests/xla) run in their own venv: torch 2.9.0 + torch_xla 2.9.0; reused once made
bash scripts/setup_xla.sh > /dev/null
# Byte-compile our own code once: where PYTHONDONTWRITEBYTECODE is set (as on the machine this was measured on) every
# process of the suite, hundreds of ranks, otherwise compiles the package again (~0.35 CPU-s each)
.venv/bin/python -m compileall -q src tests > /dev/null
SITE="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$SITE"
rm -rf "$SITE"
export OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1
# Two workers (pytest-xdist), each taking whole files (a file's module fixtures run once) in tests/conftest.py's
# order, slowest first: the suite is CPU-bound, and two keep this 2-core machine's cores busy where one left
# a third of the time idle (ranks waiting on each other, one-process references, sleeps). SHARDTRAIN_TEST_WORKERS=0
# runs everything in this process.
WORKERS="${SHARDTRAIN_TEST_WORKERS:-2}"
XDIST=()
[[ "$WORKERS" != 0 ]] && XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
exec .venv/bin/python -m pytest -q --durations=30 ${XDIST[@]+"${XDIST[@]}"} "$@"  # the 30 slowest, for whoever next cuts the time
