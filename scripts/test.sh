#!/usr/bin/env bash
# Set up the venvs if needed (.venv, and the XLA one: scripts/setup_xla.sh), build the documentation (strict: a
# broken link, a missing page or a documented symbol that is gone fails), then run the whole test suite on CPU.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the TPU path's tests (tests/xla) run in their own venv: torch 2.9.0 + torch_xla 2.9.0; reused once made
bash scripts/setup_xla.sh > /dev/null
SITE="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$SITE"
rm -rf "$SITE"
export OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1
exec .venv/bin/python -m pytest -q --durations=30 "$@"  # the 30 slowest, for whoever next cuts the time
