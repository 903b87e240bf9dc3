#!/usr/bin/env bash
# Set up the venv if needed, then run the whole test suite on CPU.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1
exec .venv/bin/python -m pytest -q "$@"
